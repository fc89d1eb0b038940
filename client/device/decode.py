"""Decoding on the client: JPEG batches (``RemoteDataLoader(..., decode_on_client=True)``).

The server then sends each sample's file as it is (``IMAGE_ENCODING_JPEG``, ``server/compute/encoded.py``):
``jpeg`` uint8 [total bytes], ``jpeg_offsets`` int64 [B + 1], ``jpeg_resize`` int64 [2] ((height,
width) to resize to, (0, 0) for none), ``jpeg_reduce`` int64 [B] (the DCT scaling 1/n the server
would have decoded each at) besides ``label``, ``index``, ``position``. Here they become
``image`` uint8 [B, H, W, 3] (RGB) again, then ``gpu_transform`` runs as for a decoded batch:

* on a CUDA device, when torchvision >= 0.19 imports (the first to decode lists on CUDA; the
  ``gpu`` extra): one batched nvJPEG call on the loader's side stream (``decode_gpu``), then what
  OpenCV, hence the server, does and nvJPEG does not: the ``jpeg_reduce`` scaling (nvJPEG has no
  DCT scaling), the EXIF orientation (torchvision ignores it on CUDA) and the resize. Not the
  same bytes as OpenCV's decode (IDCT and chroma upsampling differ), but the same scale of detail;
* otherwise (CPU, or torchvision missing): OpenCV, exactly as the server decodes (``decode_cpu``,
  resizing unless the image already has the size, as albumentations' Resize): the same bytes as
  the server's decoded stream.

A file the decoder refuses is the dataset's ``on_error`` (``DatasetInfo.on_error``, which the
server reports): "raise" raises SampleError naming the dataset and sample; "skip" leaves the
sample out of the batch and adds its index to ``skipped``, as the server does for a file it
cannot read. (The server has checked each file's headers; what it cannot see, e.g. a missing
quantisation table, fails here.)
"""

from __future__ import annotations

import functools
import logging
import re
import struct
import threading
from typing import Any, Callable, NamedTuple

import numpy as np
import torch

from batchd import wire
from batchd.client.transport import fields
from batchd.client.device.transfer import finish
from batchd.errors import SampleError, ShapeMismatchError

log = logging.getLogger(__name__)

ENCODED = ("jpeg", "jpeg_offsets", "jpeg_resize", "jpeg_reduce")
ON_ERROR = ("raise", "skip")
TORCHVISION_MIN = (0, 19)  # decode_jpeg(list of files, device="cuda"): batched nvJPEG


class Decoded(NamedTuple):
    """A JPEG batch decoded: ``image`` uint8 [B - K, H, W, 3] RGB; ``left_out`` the K positions
    in the batch (0..B-1, increasing) of files the decoder refused (dataset ``on_error: skip``)."""

    image: torch.Tensor
    left_out: list[int]


def is_encoded(raw: wire.WireBatch) -> bool:
    """True if the server sent this batch's images as JPEG files (a ``jpeg`` tensor)."""
    return any(t.name == "jpeg" for t in raw.tensors)


def _encoded(batch: dict[str, torch.Tensor]
             ) -> tuple[list[tuple[torch.Tensor, int, int]], tuple[int, int] | None]:
    """A JPEG batch's samples, each (file, index, reduce): the file a uint8 [n_i] CPU view of
    ``batch["jpeg"]`` (no copy), its dataset index, the DCT scaling 1/reduce it decodes at; and
    the (height, width) its images are resized to, or None (``jpeg_resize`` (0, 0)).

    Raises ValueError if ``jpeg_offsets`` is not int64 [B + 1], increasing, within ``jpeg``, or a
    ``jpeg_reduce`` is not 1, 2, 4 or 8.
    """
    data, offsets = batch["jpeg"], batch["jpeg_offsets"]
    bounds = offsets.tolist()
    if (offsets.dim() != 1 or bounds[:1] != [0] or bounds[-1] != data.numel()
            or any(a > b for a, b in zip(bounds, bounds[1:]))):
        raise ValueError(f"the server sent jpeg_offsets {bounds[:8]}... that do not split jpeg of {data.numel()} bytes")
    h, w = (int(v) for v in batch["jpeg_resize"].tolist())
    files = [data[a:b] for a, b in zip(bounds, bounds[1:])]
    reduce = batch["jpeg_reduce"].tolist() if "jpeg_reduce" in batch else [1] * len(files)
    samples = list(zip(files, batch["index"].tolist(), reduce))
    for _, index, n in samples:
        if n not in (1, 2, 4, 8):
            raise ValueError(f"the server sent jpeg_reduce {n} for sample {index} (expected 1, 2, 4 or 8)")
    return samples, ((h, w) if h and w else None)


def decode_cpu(batch: dict[str, torch.Tensor], dataset: str = "", on_error: str = "raise") -> Decoded:
    """OpenCV decode of a JPEG batch, as the server decodes: ``Decoded`` (image on the CPU).

    A file OpenCV cannot decode raises SampleError (dataset, index, ``#index``: the client does
    not know the file's name), or is left out with ``on_error="skip"``. Raises
    ShapeMismatchError if images of different sizes meet without a resize.
    """
    import cv2  # (here only: a loader that decodes nothing itself needs no OpenCV)

    samples, size = _encoded(batch)
    flags = {1: cv2.IMREAD_COLOR, 2: cv2.IMREAD_REDUCED_COLOR_2, 4: cv2.IMREAD_REDUCED_COLOR_4,
             8: cv2.IMREAD_REDUCED_COLOR_8}
    out, kept, left_out = None, 0, []
    for i, (f, index, n) in enumerate(samples):
        bgr = cv2.imdecode(f.numpy(), flags[n])
        if bgr is None:
            _refused(dataset, index, f"OpenCV cannot decode the JPEG sent ({f.numel()} bytes)", on_error)
            left_out.append(i)
            continue
        rgb = cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB)
        if size is not None and rgb.shape[:2] != size:
            rgb = cv2.resize(rgb, (size[1], size[0]), interpolation=cv2.INTER_LINEAR)
        if out is None:
            out, first = np.empty((len(samples), *rgb.shape), np.uint8), index
        elif rgb.shape != out.shape[1:]:
            raise _mismatch(dataset, index, rgb.shape, first, out.shape[1:])
        out[kept] = rgb
        kept += 1
    if out is None:  # every sample was skipped: as the server's empty decoded batch
        out = np.empty((0, 0, 0, 3), np.uint8)
    return Decoded(torch.from_numpy(out[:kept]), left_out)


def _refused(dataset: str, index: int, reason: str, on_error: str) -> None:
    """A file the decoder refused: raises SampleError unless ``on_error`` is "skip"."""
    if on_error not in ON_ERROR:
        raise ValueError(f"on_error must be one of {ON_ERROR}, got {on_error!r}")
    if on_error == "raise":
        raise SampleError(dataset, index, f"#{index}", reason)
    log.warning("dataset %r: sample %d left out (on_error: skip): %s", dataset, index, reason)


def leave_out(batch: dict[str, torch.Tensor], positions: list[int]) -> None:
    """Drop the samples at ``positions`` (in the batch) from every per-sample tensor of ``batch``
    (those whose first dimension is the batch's size, e.g. label, index, position) and append
    their indices to ``batch["skipped"]`` (int64 [K], created if absent). In place."""
    if not positions:
        return
    b = int(batch["index"].shape[0])
    keep = torch.ones(b, dtype=torch.bool)
    keep[positions] = False
    skipped = batch["index"][~keep]
    for name, t in list(batch.items()):
        if name != "skipped" and t.dim() and t.shape[0] == b:
            batch[name] = t[keep]
    before = batch.get("skipped", torch.empty(0, dtype=torch.int64))
    batch["skipped"] = torch.cat([before, skipped])


def _mismatch(dataset: str, index: int, shape, first: int, first_shape) -> ShapeMismatchError:
    return ShapeMismatchError(
        f"dataset {dataset!r}: sample {index} decodes to {list(shape)} but sample {first} to {list(first_shape)}; "
        "images of a batch must have one shape (add a Resize(height, width) to the transform)")


def decodes_lists_on_cuda(version: str) -> bool:
    """Whether torchvision ``version`` (e.g. "0.19.1+cu121") decodes lists of JPEGs on CUDA in one call."""
    m = re.match(r"(\d+)\.(\d+)", version)
    return m is not None and (int(m[1]), int(m[2])) >= TORCHVISION_MIN


@functools.cache
def _torchvision_decoder() -> Any:
    """torchvision.io.decode_jpeg and ImageReadMode.RGB, or None if torchvision does not load or
    is older than TORCHVISION_MIN."""
    try:
        import torchvision
        from torchvision.io import ImageReadMode, decode_jpeg
    except Exception as e:  # ImportError, or a build that does not match torch (RuntimeError, OSError)
        log.info("torchvision does not load (%s: %s): JPEG batches decode with OpenCV on the CPU", type(e).__name__, e)
        return None
    version = getattr(torchvision, "__version__", "")
    if not decodes_lists_on_cuda(version):
        log.warning("torchvision %s cannot decode lists of JPEGs on CUDA (needs >= %d.%d: pip install "
                    "'batchd[gpu]'): JPEG batches decode with OpenCV on the CPU", version or "(no version)",
                    *TORCHVISION_MIN)
        return None
    return decode_jpeg, ImageReadMode.RGB


def gpu_decode_available(device: torch.device) -> bool:
    """Whether JPEG batches for ``device`` decode there with nvJPEG (a CUDA device, torchvision >= 0.19)."""
    return device.type == "cuda" and _torchvision_decoder() is not None


def exif_orientation(data: Any) -> int:
    """The EXIF orientation (1..8) of a JPEG file's APP1 segment; 1 if it has none or it is malformed."""
    mv = memoryview(np.asarray(data, dtype=np.uint8).reshape(-1)).cast("B") if not isinstance(data, bytes) else data
    n, pos = len(mv), 2
    try:
        while pos + 4 <= n and mv[pos] == 0xFF:
            marker = mv[pos + 1]
            if marker in (0xD9, 0xDA):
                return 1
            (length,) = struct.unpack_from(">H", mv, pos + 2)
            if marker == 0xE1 and bytes(mv[pos + 4 : pos + 10]) == b"Exif\0\0":
                return _tiff_orientation(bytes(mv[pos + 10 : pos + 2 + length]))
            pos += 2 + length
    except (struct.error, IndexError):
        pass
    return 1


def _tiff_orientation(tiff: bytes) -> int:
    order = {b"II": "<", b"MM": ">"}.get(tiff[:2])
    if order is None:
        return 1
    try:
        (ifd,) = struct.unpack_from(order + "I", tiff, 4)
        (count,) = struct.unpack_from(order + "H", tiff, ifd)
        for k in range(count):
            tag, kind, _, value = struct.unpack_from(order + "HHIH", tiff, ifd + 2 + 12 * k)
            if tag == 0x0112 and kind == 3:
                return value if 1 <= value <= 8 else 1
    except struct.error:
        pass
    return 1


# EXIF orientation -> (whether [C, H, W] is transposed first, the dimensions then flipped)
_ORIENTATIONS = {2: (False, (-1,)), 3: (False, (-2, -1)), 4: (False, (-2,)), 5: (True, ()),
                 6: (True, (-1,)), 7: (True, (-2, -1)), 8: (True, (-2,))}


def orient(image: torch.Tensor, orientation: int) -> torch.Tensor:
    """``image`` [C, H, W] as displayed for EXIF ``orientation`` (what OpenCV's IMREAD_COLOR applies)."""
    transpose, flips = _ORIENTATIONS.get(orientation, (False, ()))
    image = image.transpose(-2, -1) if transpose else image
    return image.flip(flips) if flips else image


def resize_bilinear(image: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """uint8 [C, H, W] resized to ``size`` (height, width) like OpenCV's INTER_LINEAR (half-pixel
    centres, no antialiasing), rounded to uint8; returned as it is when it already has the size."""
    if tuple(image.shape[-2:]) == tuple(size):
        return image
    x = torch.nn.functional.interpolate(image[None].float(), size=size, mode="bilinear", align_corners=False)
    return x[0].round_().clamp_(0, 255).to(torch.uint8)


def reduce_like_libjpeg(image: torch.Tensor, n: int) -> torch.Tensor:
    """uint8 [C, H, W] at 1/n (n = 1, 2, 4 or 8) as libjpeg's DCT scaling decodes it: [C, ceil(H/n),
    ceil(W/n)], each pixel the mean of its n x n block (partial blocks at the edges), rounded.

    A downscale that follows ``jpeg_reduce`` keeps the server's scale of detail: from a full decode,
    a bilinear resize to a quarter aliases (mean |diff| from the server's bytes 12-35 of 255 on
    finely textured images, about 9 with ``antialias=True``, 0.7-2.2 reduced so first;
    tests/client/test_decode_gpu_path.py).
    """
    if n == 1:
        return image
    x = torch.nn.functional.avg_pool2d(image[None].float(), n, ceil_mode=True)
    return x[0].round_().clamp_(0, 255).to(torch.uint8)


def decode_gpu(batch: dict[str, torch.Tensor], device: torch.device, dataset: str = "",
               on_error: str = "raise") -> Decoded:
    """nvJPEG decode of a JPEG batch on ``device`` (torchvision, one batched call, on the current
    stream), reduced as ``jpeg_reduce`` says (``reduce_like_libjpeg``), oriented (EXIF) and resized:
    ``Decoded`` with the image on ``device``.

    If the batched call fails, each file is decoded alone: one nvJPEG refuses raises SampleError
    (dataset, index, ``#index``), or is left out with ``on_error="skip"``; if it refuses every
    file of the batch, its first error is raised as it is (a device fault, not the files').
    Raises RuntimeError if torchvision does not load; ShapeMismatchError as ``decode_cpu``.
    """
    decoder = _torchvision_decoder()
    if decoder is None:
        raise RuntimeError("decoding JPEG batches on the GPU needs torchvision >= 0.19 (pip install 'batchd[gpu]')")
    decode_jpeg, rgb = decoder
    samples, size = _encoded(batch)
    decode = functools.partial(decode_jpeg, mode=rgb, device=device)
    images, left_out = _decode_each(samples, decode, dataset, on_error) if samples else ([], [])
    out = []  # each [H, W, 3]
    for i, image in images:
        f, index, n = samples[i]
        image = orient(reduce_like_libjpeg(image, n), exif_orientation(f.numpy()))
        if size is not None:
            image = resize_bilinear(image, size)
        image = image.permute(1, 2, 0)
        if out and image.shape != out[0].shape:
            raise _mismatch(dataset, index, image.shape, samples[images[0][0]][1], out[0].shape)
        out.append(image)
    if not out:
        return Decoded(torch.empty((0, 0, 0, 3), dtype=torch.uint8, device=device), left_out)
    return Decoded(torch.stack(out), left_out)


def _decode_each(samples: list[tuple[torch.Tensor, int, int]],
                 decode: Callable[[list[torch.Tensor]], list[torch.Tensor]], dataset: str,
                 on_error: str) -> tuple[list[tuple[int, torch.Tensor]], list[int]]:
    """``decode`` of the samples' files in one call; if it raises, file by file. Returns
    ([(position, image)], positions left out); see ``decode_gpu`` for the errors."""
    files = [f for f, _, _ in samples]
    try:
        return list(enumerate(decode(files))), []
    except RuntimeError as batch_error:
        images, refused = [], []
        for i, f in enumerate(files):
            try:
                images.append((i, decode([f])[0]))
            except RuntimeError as e:
                refused.append((i, e))
        if len(refused) == len(files) > 1:
            raise batch_error
        for i, e in refused:
            reason = f"nvJPEG cannot decode the JPEG sent ({files[i].numel()} bytes): {e}"
            _refused(dataset, samples[i][1], reason, on_error)
        return images, [i for i, _ in refused]


def decode_batch(batch: dict[str, torch.Tensor], options: Any, transfer: Any, stopping: threading.Event | None,
                 epoch: int, on_error: str = "raise") -> tuple[dict[str, torch.Tensor], Any]:
    """Receiver thread: a JPEG batch (CPU tensors) as a decoded one, on the loader's device, finished
    by ``options.gpu_transform``. Returns (batch, CUDA event of its copy or None), as
    ``CudaTransfer.to_device``; ``batch["image"]`` is uint8 [B, H, W, 3] (or what gpu_transform made).

    on_error: the dataset's (``DatasetInfo.on_error``); with "skip", files the decoder refuses are
    left out (``leave_out``). With a CUDA ``transfer`` and torchvision: decoded on the transfer's
    side stream, to this thread alone (``CudaTransfer.exclusive``), which waits for the decode to
    finish (the files may lie on a leased slot that goes back when they are freed). Otherwise
    OpenCV on the CPU, then the copy as for any batch. Raises TransferStopped if ``stopping`` is
    set, and the errors of ``decode_cpu`` / ``decode_gpu``.
    """
    rest = {k: v for k, v in batch.items() if k not in ENCODED}
    gpu_transform, seed = options.gpu_transform, options.seed
    if transfer is not None and gpu_decode_available(transfer.device):
        with transfer.exclusive(stopping):
            decoded = decode_gpu(batch, transfer.device, options.dataset, on_error)
            leave_out(rest, decoded.left_out)
            out = {k: fields.map_values(v, lambda t: t.to(transfer.device, non_blocking=True))
                   for k, v in rest.items()}
            out["image"] = decoded.image
            if gpu_transform is not None:
                finish(out, gpu_transform, seed, epoch)
            event = torch.cuda.Event(blocking=True)
            event.record(transfer.stream)
        event.synchronize()
        return out, event
    decoded = decode_cpu(batch, options.dataset, on_error)
    leave_out(rest, decoded.left_out)
    rest["image"] = decoded.image
    if transfer is not None:
        return transfer.to_device(rest, stopping, finish=gpu_transform, seed=seed, epoch=epoch)
    if gpu_transform is not None:
        finish(rest, gpu_transform, seed, epoch)
    return rest, None
