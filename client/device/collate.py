"""``collate_fn``: a received batch handed to the user's function as B samples, as torch's
``DataLoader`` hands a batch of ``Dataset`` items to its ``collate_fn``.

``RemoteDataLoader(..., collate_fn=fn)`` yields ``fn(samples)`` instead of the dict batch, where
``samples`` is a list of B dicts, sample i holding

* row i of each stacked field: a tensor of the sample's own shape (a view, no copy); a field of
  one number per sample (``label``, ``index``, ``position``) gives a 0-d tensor, as a ``Dataset``
  returning tensors would (``int(sample["index"])`` for a Python int);
* the i-th tensor of each ragged field (a view of the field's one buffer);
* the i-th str / bytes of a str / bytes field.

So ``torch.utils.data.default_collate`` rebuilds the dict batch wherever shapes agree, and
``detection_collate`` (below) gives torchvision's detection models their (images, targets), as
``tuple(zip(*x))`` does over its references' (image, target) samples (``tuple(zip(*x))`` over
dict samples gives the dicts' keys, with DataLoader too).
A batch's ``skipped`` indices (dataset ``on_error: skip``) are not a sample: ``fn`` gets the
B - K samples that were read.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

BATCH_FIELDS = ("skipped",)  # fields of the batch, not of its samples


def samples(batch: dict[str, Any]) -> list[dict[str, Any]]:
    """The B samples of an unpacked batch (``batchd.client.transport.fields.unpack``), in batch order.

    Raises ValueError naming the fields if they disagree on B (a malformed batch).
    """
    per_sample = {k: v for k, v in batch.items() if k not in BATCH_FIELDS}
    counts = {k: len(v) if isinstance(v, list) else (v.shape[0] if v.dim() else -1) for k, v in per_sample.items()}
    if len(set(counts.values())) > 1 or -1 in counts.values():
        raise ValueError("the batch's fields disagree on its number of samples: "
                         + ", ".join(f"{k} {'[]' if n < 0 else n}" for k, n in counts.items()))
    b = next(iter(counts.values()), 0)
    return [{k: v[i] for k, v in per_sample.items()} for i in range(b)]


def collate(batch: dict[str, Any], collate_fn: Callable[[list[dict[str, Any]]], Any]) -> Any:
    """``collate_fn(samples(batch))``: what the loader yields with a ``collate_fn``."""
    return collate_fn(samples(batch))


def detection_collate(samples: Sequence[dict[str, Any]], *, image: str = "image") -> tuple[tuple, tuple]:
    """``(images, targets)`` for torchvision's detection models, from B dict samples.

    ``images``: a tuple of the B samples' ``image`` tensors (as the server sends them: uint8
    [H_i, W_i, C] unless the pipeline changes the dtype; torchvision's models take float [C, H, W]
    in [0, 1]: ``im.permute(2, 0, 1).float().div(255)``). ``targets``: a tuple of B dicts, each the
    sample's other fields in the batch's order (``index``, ``position``, then e.g. ``boxes``
    float32 [N_i, 4] xyxy pixels, ``labels`` int64 [N_i], ``masks`` uint8 [N_i, H_i, W_i],
    ``image_id``...). This is exactly what ``DataLoader(..., collate_fn=lambda x: tuple(zip(*x)))``
    gives over a ``Dataset`` of ``(image, target)`` pairs, torchvision's detection references'
    convention, except that a batch whose every sample was skipped gives ``((), ())`` (a pair
    still). The samples are not modified. ``image``: the name of the image field.

    Use: ``RemoteDataLoader(..., collate_fn=batchd.detection_collate)``;
    ``for images, targets in loader: loss = sum(model(list(images), list(targets)).values())``.

    Raises ValueError naming the sample (its position in the batch and its ``index``) and its
    fields if a sample has no ``image`` field.
    """
    images, targets = [], []
    for i, sample in enumerate(samples):
        if image not in sample:
            index = sample.get("index")
            where = f" (dataset index {int(index)})" if index is not None else ""
            raise ValueError(f"detection_collate: sample {i} of the batch{where} has no {image!r} field; "
                             f"its fields: {sorted(sample)}")
        images.append(sample[image])
        targets.append({k: v for k, v in sample.items() if k != image})
    return tuple(images), tuple(targets)
