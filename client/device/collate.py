"""``collate_fn``: a received batch handed to the user's function as B samples, as torch's
``DataLoader`` hands a batch of ``Dataset`` items to its ``collate_fn`` (what a sample holds:
``RemoteDataLoader``'s ``collate_fn``; a 0-d tensor for a field of one number per sample, as a
``Dataset`` returning tensors would: ``int(sample["index"])`` for a Python int).

``detection_collate`` gives torchvision's detection models their (images, targets), as
``tuple(zip(*x))`` does over its references' (image, target) samples (``tuple(zip(*x))`` over
dict samples gives the dicts' keys, with DataLoader too).
"""

from __future__ import annotations

import functools
from typing import Any, Mapping, Sequence

BATCH_FIELDS = ("skipped",)  # fields of the batch, not of its samples
BBOX_FORMATS = ("pascal_voc", "coco", "yolo", "albumentations")  # albumentations' BboxParams formats


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


def detection_collate(samples: Sequence[dict[str, Any]], *, image: str = "image",
                      bbox_format: str = "pascal_voc") -> tuple[tuple, tuple]:
    """``(images, targets)`` for torchvision's detection models, from B dict samples.

    ``images``: a tuple of the B samples' ``image`` tensors (as the server sends them: uint8
    [H_i, W_i, C] unless the pipeline changes the dtype; torchvision's models take float [C, H, W]
    in [0, 1]: ``im.permute(2, 0, 1).float().div(255)``). ``targets``: a tuple of B dicts, each the
    sample's other fields in the batch's order (``index``, ``position``, then e.g. ``boxes``
    float32 [N_i, 4] xyxy pixels, ``labels`` int64 [N_i], ``masks`` uint8 [N_i, H_i, W_i],
    ``image_id``...). This is exactly what ``DataLoader(..., collate_fn=lambda x: tuple(zip(*x)))``
    gives over a ``Dataset`` of ``(image, target)`` pairs, torchvision's detection references'
    convention, except that a batch whose every sample was skipped gives ``((), ())`` (a pair
    still). ``image``: the name of the image field.

    ``boxes`` are torchvision's xyxy pixels whatever ``bbox_format`` the pipeline's ``BboxParams``
    gave them in: ``bbox_format`` (pascal_voc, coco, yolo, albumentations) names it, and boxes of
    another format are converted with the sample's image size (H_i, W_i; new float32 tensors). A
    ``RemoteDataLoader`` whose transform carries ``bbox_params`` passes its format itself
    (``bind_bbox_format``); give it here for a server preset (its format is the server's). The
    samples are not modified.

    Use: ``RemoteDataLoader(..., collate_fn=batchd.detection_collate)``;
    ``for images, targets in loader: loss = sum(model(list(images), list(targets)).values())``.

    Raises ValueError naming the sample (its position in the batch and its ``index``) and its
    fields if a sample has no ``image`` field, or for an unknown ``bbox_format``.
    """
    if bbox_format not in BBOX_FORMATS:
        raise ValueError(f"detection_collate: bbox_format must be one of {list(BBOX_FORMATS)}, got {bbox_format!r}")
    images, targets = [], []
    for i, sample in enumerate(samples):
        if image not in sample:
            index = sample.get("index")
            where = f" (dataset index {int(index)})" if index is not None else ""
            raise ValueError(f"detection_collate: sample {i} of the batch{where} has no {image!r} field; "
                             f"its fields: {sorted(sample)}")
        images.append(sample[image])
        target = {k: v for k, v in sample.items() if k != image}
        if bbox_format != "pascal_voc" and "boxes" in target:
            target["boxes"] = _xyxy(target["boxes"], bbox_format, *sample[image].shape[:2])
        targets.append(target)
    return tuple(images), tuple(targets)


def _xyxy(boxes: Any, bbox_format: str, height: int, width: int) -> Any:
    """float32 [N, 4] boxes of ``bbox_format`` in an image ``height`` x ``width`` as xyxy pixels
    (albumentations' definitions: coco [x, y, w, h] pixels; yolo [x_center, y_center, w, h] and
    albumentations [x_min, y_min, x_max, y_max], both divided by W and H)."""
    a, b, c, d = boxes[..., 0], boxes[..., 1], boxes[..., 2], boxes[..., 3]
    if bbox_format == "coco":
        columns = (a, b, a + c, b + d)
    elif bbox_format == "yolo":
        columns = ((a - c / 2) * width, (b - d / 2) * height, (a + c / 2) * width, (b + d / 2) * height)
    else:
        columns = (a * width, b * height, c * width, d * height)
    if hasattr(boxes, "new_empty"):  # a torch tensor (what a loader's samples hold)
        import torch

        return torch.stack(columns, -1).to(boxes.dtype)
    import numpy as np

    return np.stack(columns, -1).astype(boxes.dtype, copy=False)


def bind_bbox_format(collate_fn: Any, transform: Any) -> Any:
    """``collate_fn``, or ``detection_collate`` told the bbox format of ``transform`` (an
    albumentations Compose with ``bbox_params``): what ``RemoteDataLoader`` hands its batches
    to, so its boxes come out as xyxy pixels whatever the format. A ``functools.partial`` of
    ``detection_collate`` that names another format than the transform's raises ValueError;
    other functions, and presets (the client cannot see their format), are left as they are."""
    if collate_fn is detection_collate:
        given = None
    elif isinstance(collate_fn, functools.partial) and collate_fn.func is detection_collate:
        given = collate_fn.keywords.get("bbox_format", "pascal_voc")
    else:
        return collate_fn
    fmt = _transform_bbox_format(transform)
    if fmt is None:
        return collate_fn
    if given is None:
        return collate_fn if fmt == "pascal_voc" else functools.partial(detection_collate, bbox_format=fmt)
    if given != fmt:
        raise ValueError(f"detection_collate was told bbox_format={given!r}, but the transform's bbox_params "
                         f"give the boxes in {fmt!r}: pass collate_fn=batchd.detection_collate (it takes "
                         "the transform's format), or ask for A.BboxParams(format='pascal_voc'), torchvision's "
                         "xyxy")
    return collate_fn


def _transform_bbox_format(transform: Any) -> str | None:
    """The ``bbox_params`` format of an albumentations transform (None: a preset name, no
    transform, or no bbox_params: the server's default, pascal_voc, applies then). A mix's
    mapping {source: transform}: the one format its transforms name; ValueError if they name
    several (the batch's boxes would come in more than one)."""
    if isinstance(transform, Mapping):
        formats = {_transform_bbox_format(t) or "pascal_voc" for t in transform.values()}
        if len(formats) > 1:
            raise ValueError(f"the mix's transforms give boxes in several formats ({', '.join(sorted(formats))}): "
                             "a batch holds samples of every source, so give them one bbox_params format")
        return next(iter(formats), None)
    if transform is None or isinstance(transform, str):
        return None
    params = getattr(transform, "processors", {}).get("bboxes")
    return getattr(getattr(params, "params", None), "format", None)
