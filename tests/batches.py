"""Batches of samples with targets, built and read by hand from loader.proto's ``Tensor`` comment.

The tests' reference for the wire layout, independent of batchd's code: ``pack`` lays B samples
(dicts of numpy arrays, ints, str, bytes) out as the proto says a server sends them (stacked
where the samples' shapes agree, else ragged: values back to back + per-sample shapes + element
offsets; str/bytes always ragged uint8), ``unpack`` reads one ``pb.Tensor`` back into the B
samples' values as a client in another language would, from the comment alone. ``detection_samples``
makes samples of the kinds issue 19 names (images of different sizes, N boxes per image with
N = 0 among them, masks, a class label, str and bytes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from batchd.v1 import loader_pb2 as pb


@dataclass(frozen=True)
class Field:
    """One field of a batch as a server lays it out: ``values`` (C-order bytes) of ``dtype`` and
    ``shape``; ``sample_shapes`` None when stacked ([B, ...]), else each sample's shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    values: bytes
    sample_shapes: tuple[tuple[int, ...], ...] | None = None

    @property
    def sample_ndim(self) -> int:
        if self.sample_shapes is None:
            return 0
        return len(self.sample_shapes[0]) if self.sample_shapes else 1

    @property
    def flat_shapes(self) -> list[int]:
        return [d for s in self.sample_shapes or () for d in s]

    @property
    def offsets(self) -> list[int]:
        if self.sample_shapes is None:
            return []
        return np.concatenate([[0], np.cumsum([int(np.prod(s)) for s in self.sample_shapes])]).astype(int).tolist()

    def proto(self) -> pb.Tensor:
        """This field as an inline ``pb.Tensor``."""
        return pb.Tensor(name=self.name, dtype=self.dtype, shape=list(self.shape), data=self.values,
                         sample_ndim=self.sample_ndim, sample_shapes=self.flat_shapes, sample_offsets=self.offsets)


def _kind(value: Any) -> str:
    if isinstance(value, str):
        return "str"
    if isinstance(value, bytes):
        return "bytes"
    return np.asarray(value).dtype.name


def pack(samples: list[dict[str, Any]], names: list[str] | None = None) -> list[Field]:
    """The fields of a batch of ``samples`` (B >= 1 dicts with the same keys), in ``names`` order."""
    out = []
    for name in names or list(samples[0]):
        kind = _kind(samples[0][name])
        if kind in ("str", "bytes"):
            raw = [v.encode() if kind == "str" else v for v in (s[name] for s in samples)]
            out.append(Field(name, kind, (sum(map(len, raw)),), b"".join(raw), tuple((len(r),) for r in raw)))
            continue
        arrays = [np.array(s[name], dtype=kind) for s in samples]
        if len({a.shape for a in arrays}) == 1:
            stacked = np.stack(arrays)
            out.append(Field(name, kind, stacked.shape, stacked.tobytes()))
        else:
            flat = np.concatenate([a.reshape(-1) for a in arrays])
            out.append(Field(name, kind, flat.shape, flat.tobytes(), tuple(a.shape for a in arrays)))
    return out


def unpack(t: pb.Tensor, data: bytes) -> list[Any]:
    """The B samples' values of field ``t`` (its bytes ``data``: inline, or read from the segment at
    ``t.offset``), following only loader.proto's comment on ``Tensor``."""
    if t.sample_ndim == 0:
        stacked = np.frombuffer(data, dtype=np.dtype(t.dtype).newbyteorder("<")).reshape(tuple(t.shape))
        return list(stacked)
    elem = np.dtype("uint8") if t.dtype in ("str", "bytes") else np.dtype(t.dtype).newbyteorder("<")
    values = np.frombuffer(data, dtype=elem)
    assert values.shape == tuple(t.shape)
    b = len(t.sample_offsets) - 1
    out = []
    for i in range(b):
        shape = tuple(t.sample_shapes[i * t.sample_ndim:(i + 1) * t.sample_ndim])
        v = values[t.sample_offsets[i]:t.sample_offsets[i + 1]].reshape(shape)
        out.append(v.tobytes().decode() if t.dtype == "str" else v.tobytes() if t.dtype == "bytes" else v)
    return out


def detection_samples(indices, seed: int = 0, *, fixed_size: bool = False, objects: int | None = None
                      ) -> list[dict[str, Any]]:
    """One sample per dataset index: image uint8 [H, W, 3] (H, W vary unless ``fixed_size``), boxes
    float32 [N, 4] (xyxy, N = index % 4 unless ``objects`` fixes it, so N = 0 occurs), labels int64
    [N], masks uint8 [N, H, W], label int64 [] (a class), name str (non-ASCII among them), blob
    bytes, index int64 []. A pure function of (index, seed)."""
    out = []
    for i in indices:
        rng = np.random.default_rng([seed, int(i)])
        h, w = (6, 8) if fixed_size else (int(rng.integers(4, 9)), int(rng.integers(4, 9)))
        n = int(i) % 4 if objects is None else objects
        x0 = rng.uniform(0, w / 2, n)
        y0 = rng.uniform(0, h / 2, n)
        boxes = np.stack([x0, y0, x0 + rng.uniform(1, w / 2, n), y0 + rng.uniform(1, h / 2, n)], axis=1)
        out.append({
            "image": rng.integers(0, 256, (h, w, 3), dtype=np.uint8),
            "boxes": boxes.astype(np.float32).reshape(n, 4),
            "labels": rng.integers(1, 91, n).astype(np.int64),
            "masks": rng.integers(0, 2, (n, h, w), dtype=np.uint8),
            "label": np.int64(int(i) % 10),
            "name": f"img-{int(i)}-{'é' * (int(i) % 3)}",
            "blob": bytes(rng.integers(0, 256, int(i) % 5, dtype=np.uint8)),
            "index": np.int64(i),
        })
    return out


def torch_sample(i: int, **kw) -> dict[str, Any]:
    """``detection_samples([i], **kw)[0]`` as a torch ``Dataset`` would return it (for DataLoader
    oracles): tensors (0-d for numbers), str and bytes as they are, plus ``position`` int64 [] = i
    (the server's position with no shuffle and one rank)."""
    import torch

    (sample,) = detection_samples([i], **kw)
    out = {k: v if isinstance(v, str | bytes) else torch.from_numpy(np.array(v)) for k, v in sample.items()}
    out["position"] = torch.tensor(i)
    return out


def assert_batch_holds(batch: dict[str, Any], samples: list[dict[str, Any]]) -> None:
    """A loader's dict batch holds exactly ``samples``, field by field: a field whose samples agree
    in shape is a tensor [B, ...] of their dtype; otherwise a list of B tensors, views of one buffer
    (the same storage, at the offsets of the samples' sizes); str / bytes fields are lists of B
    str / bytes. Every value equal to the sample's."""
    import torch

    b = len(samples)
    for name in samples[0]:
        value, want = batch[name], [s[name] for s in samples]
        if isinstance(want[0], str | bytes):
            assert value == want, name
            continue
        want = [np.asarray(w) for w in want]
        dtype = getattr(torch, want[0].dtype.name)
        if len({w.shape for w in want}) == 1:
            assert isinstance(value, torch.Tensor), f"{name}: samples of one shape must be stacked"
            assert value.dtype == dtype and tuple(value.shape) == (b, *want[0].shape), name
            for i, w in enumerate(want):
                np.testing.assert_array_equal(value[i].cpu().numpy(), w, err_msg=f"{name}[{i}]")
            continue
        assert isinstance(value, list) and len(value) == b, f"{name}: ragged samples must be a list of {b} tensors"
        for i, (v, w) in enumerate(zip(value, want)):
            assert v.dtype == dtype and tuple(v.shape) == w.shape, f"{name}[{i}]"
            np.testing.assert_array_equal(v.cpu().numpy(), w, err_msg=f"{name}[{i}]")
        assert_views_of_one_buffer(name, value)


def assert_views_of_one_buffer(name: str, views: list) -> None:
    """The per-sample tensors of a ragged field are views of one storage, back to back in order."""
    storages = {v.untyped_storage().data_ptr() for v in views}
    assert len(storages) == 1, f"{name}: the samples lie in {len(storages)} buffers, not one"
    expected = views[0].storage_offset()
    for i, v in enumerate(views):
        assert v.is_contiguous() and v.storage_offset() == expected, f"{name}[{i}] is not where the flat buffer puts it"
        expected += v.numel()
