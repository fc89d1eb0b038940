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
``lambda x: tuple(zip(*[(s.pop("image"), s) for s in x]))`` gives torchvision's detection models
their (images, targets), as ``tuple(zip(*x))`` does over its references' (image, target) samples
(``tuple(zip(*x))`` over dict samples gives the dicts' keys, with DataLoader too).
A batch's ``skipped`` indices (dataset ``on_error: skip``) are not a sample: ``fn`` gets the
B - K samples that were read.
"""

from __future__ import annotations

from typing import Any, Callable

BATCH_FIELDS = ("skipped",)  # fields of the batch, not of its samples


def samples(batch: dict[str, Any]) -> list[dict[str, Any]]:
    """The B samples of an unpacked batch (``batchd.client.fields.unpack``), in batch order.

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
