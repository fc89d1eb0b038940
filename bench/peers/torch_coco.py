"""The DataLoader baseline for detection: what torchvision's detection references do, in a torch Dataset.

``CocoMasks(images, annotations, pipeline)[i] -> (image, target)``: image id i of the sorted ids
(``CocoDetection``'s order), read and decoded by OpenCV (RGB), its annotations converted as
``references/detection/coco_utils.py`` converts them (``bbox`` xywh -> xyxy float32, clamped,
boxes without area dropped; masks by pycocotools' ``annToMask``; labels, iscrowd, area), then the
same albumentations ``Compose`` a batchd server runs (``A.from_dict`` of the preset; boxes given in
its ``bbox_params`` format by albumentations' converters), with a label
field per box so that dropped boxes drop their masks, labels, iscrowd and area, as batchd's
``server/compute/targets.py`` does. The target: ``boxes`` float32 [N, 4], ``labels`` int64 [N],
``masks`` uint8 [N, H, W], ``image_id`` int64 [], ``area`` float32 [N], ``iscrowd`` int64 [N]
(torch tensors); the image uint8 [H, W, 3]. Batched with ``collate_fn=lambda x: tuple(zip(*x))``.

The COCO index is built in each worker on first use (the JSON is parsed there, not pickled), as
torchvision's ``CocoDetection`` does in the process that makes it.
"""

from __future__ import annotations

import contextlib
import io
import pathlib
import warnings

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset


class CocoMasks(Dataset):
    def __init__(self, images: pathlib.Path, annotations: pathlib.Path, pipeline: dict | None):
        self.images, self.annotations, self.pipeline = pathlib.Path(images), pathlib.Path(annotations), pipeline
        self._coco = self._compose = None
        self._len = len(self._index()[1])
        self._coco = None  # workers build their own

    def __getstate__(self):
        return {**self.__dict__, "_coco": None, "_compose": None}

    def _index(self):
        if self._coco is None:
            from pycocotools.coco import COCO

            with contextlib.redirect_stdout(io.StringIO()):
                coco = COCO(str(self.annotations))
            self._coco = coco, sorted(coco.imgs)
        return self._coco

    def _transform(self):
        if self._compose is None and self.pipeline is not None:
            import albumentations as A

            spec = A.from_dict(self.pipeline)
            params = dict(self.pipeline["transform"].get("bbox_params") or {"format": "pascal_voc"})
            self._format = params.get("format", "pascal_voc")
            params["label_fields"] = ["objects"]
            # as the server (targets.MIN_SIDE, docs/targets.md)
            params["min_width"] = max(params.get("min_width") or 0.0, 0.01)
            params["min_height"] = max(params.get("min_height") or 0.0, 0.01)
            self._compose = A.Compose(spec.transforms, bbox_params=A.BboxParams(**params))
        return self._compose

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i: int):
        import cv2

        coco, ids = self._index()
        img_id = ids[i]
        info = coco.imgs[img_id]
        image = cv2.cvtColor(cv2.imread(str(self.images / info["file_name"])), cv2.COLOR_BGR2RGB)
        h, w = image.shape[:2]
        anns = coco.loadAnns(coco.getAnnIds(imgIds=img_id))
        boxes = np.asarray([a["bbox"] for a in anns], np.float32).reshape(-1, 4)
        boxes[:, 2:] += boxes[:, :2]
        boxes[:, 0::2] = boxes[:, 0::2].clip(0, w)
        boxes[:, 1::2] = boxes[:, 1::2].clip(0, h)
        keep = (boxes[:, 3] > boxes[:, 1]) & (boxes[:, 2] > boxes[:, 0])
        anns = [a for a, k in zip(anns, keep) if k]
        boxes = boxes[keep]
        masks = np.asarray([coco.annToMask(a) for a in anns], np.uint8).reshape(-1, h, w)
        labels = np.asarray([a["category_id"] for a in anns], np.int64)
        iscrowd = np.asarray([a["iscrowd"] for a in anns], np.int64)
        area = np.asarray([a["area"] for a in anns], np.float32)
        compose = self._transform()
        if compose is not None:
            extra = {"masks": masks} if len(masks) else {}  # albumentations cannot stack no masks
            out = compose(image=image, bboxes=_in_format(boxes, self._format, (h, w)), objects=np.arange(len(boxes)),
                          **extra)
            kept = np.asarray(out["objects"], np.int64)
            image = out["image"]
            boxes = np.asarray(out["bboxes"], np.float32).reshape(-1, 4)
            masks = np.asarray(out["masks"], np.uint8)[kept] if len(masks) else \
                np.zeros((0, *image.shape[:2]), np.uint8)
            labels, iscrowd, area = labels[kept], iscrowd[kept], area[kept]
        target = {"boxes": torch.from_numpy(boxes), "labels": torch.from_numpy(labels), "masks": torch.from_numpy(masks),
                  "image_id": torch.tensor(img_id), "area": torch.from_numpy(area), "iscrowd": torch.from_numpy(iscrowd)}
        return torch.from_numpy(np.ascontiguousarray(image)), target


def _in_format(boxes: np.ndarray, fmt: str, shape: tuple[int, int]) -> np.ndarray:
    """xyxy pixel boxes in albumentations' ``fmt`` (its own converters), as the pipeline takes them."""
    if fmt == "pascal_voc" or not len(boxes):
        return boxes
    from albumentations.core import bbox_utils

    normalized = bbox_utils.convert_bboxes_to_albumentations(boxes, "pascal_voc", shape)
    return normalized if fmt == "albumentations" else bbox_utils.convert_bboxes_from_albumentations(normalized, fmt, shape)


class Order(torch.utils.data.Sampler):
    """A shuffled order set before each use (``set``), repeated to the length asked for."""

    def __init__(self):
        self.indices: list[int] = []

    def set(self, num_samples: int, count: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        order = np.concatenate([rng.permutation(num_samples) for _ in range(-(-count // num_samples))])
        self.indices = order[:count].tolist()

    def __iter__(self):
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def _init_worker(worker_id: int) -> None:
    import cv2

    cv2.setNumThreads(1)  # as batchd's workers
    ds = torch.utils.data.get_worker_info().dataset
    if ds._transform() is not None:
        ds._transform().set_random_seed(worker_id)


def zip_collate(batch):
    """torchvision's detection references' ``collate_fn``: ``tuple(zip(*batch))``."""
    return tuple(zip(*batch))


def make_loader(ds: CocoMasks, batch_size: int, workers: int, prefetch_factor: int = 2) -> tuple[DataLoader, Order]:
    """A persistent DataLoader over ``ds`` (forkserver workers: this process runs gRPC clients too)."""
    warnings.filterwarnings("ignore", message="This DataLoader will create", category=UserWarning)
    order = Order()
    kw = {"persistent_workers": True, "prefetch_factor": prefetch_factor, "worker_init_fn": _init_worker,
          "multiprocessing_context": "forkserver"} if workers else {}
    loader = DataLoader(ds, batch_size=batch_size, sampler=order, num_workers=workers, collate_fn=zip_collate,
                        drop_last=True, **kw)
    return loader, order
