"""Datasets and pipelines the tests serve as ``kind: python`` and python presets.

The server imports this module from this folder (``python_path``), as it would an operator's
package; the tests also import it themselves to compare what the server sends with what the
dataset gives in-process.
"""

from __future__ import annotations

import random
import time

import numpy as np

# distinct, saturated colours: object with label l is painted PALETTE[l]
PALETTE = np.array([(255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 0), (255, 0, 255), (0, 255, 255),
                    (255, 128, 0), (128, 0, 255)], np.uint8)


class Rectangles:
    """Filled rectangles of known colours at known boxes, one per object, never overlapping.

    Sample i (a pure function of seed and i): image uint8 [size, size, 3] (black background),
    boxes float32 [N, 4] xyxy pixels (the rectangle covers columns x0..x1-1, rows y0..y1-1),
    labels int64 [N] (distinct: the colour index), masks uint8 [N, size, size], mask
    ``mask_dtype`` [size, size] (label + 1 inside each rectangle, 0 outside; uint8 as in VOC's
    PNGs by default: OpenCV warps int32 masks with other rounding than uint8 images, by a pixel
    here and there), iscrowd int64 [N], area float32
    [N] (pixels), ids int64 [N] (i * 100 + object number: a per-object field of our own),
    keypoints float32 [N, 4, 3] (the corners (x0, y0), (x1, y0), (x1, y1), (x0, y1), visibility 2),
    name str, label int (N). N is 0 to max_objects (0 for every seventh sample).
    """

    classes = [f"colour{k}" for k in range(len(PALETTE))]

    def __init__(self, n: int = 600, size: int = 64, seed: int = 0, max_objects: int = 4, mask_dtype: str = "uint8"):
        self.n, self.size, self.seed, self.max_objects = n, size, seed, max_objects
        self.mask_dtype = np.dtype(mask_dtype)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        if not 0 <= i < self.n:
            raise IndexError(i)
        rng = np.random.default_rng([self.seed, i])
        s = self.size
        want = 0 if i % 7 == 0 else int(rng.integers(1, self.max_objects + 1))
        labels = rng.choice(len(PALETTE), size=want, replace=False)
        boxes, taken = [], np.zeros((s, s), bool)
        for _ in range(200):
            if len(boxes) == want:
                break
            w, h = rng.integers(8, 25, size=2)
            x0, y0 = int(rng.integers(0, s - w + 1)), int(rng.integers(0, s - h + 1))
            if taken[max(0, y0 - 1):y0 + h + 1, max(0, x0 - 1):x0 + w + 1].any():
                continue
            taken[y0:y0 + h, x0:x0 + w] = True
            boxes.append((x0, y0, x0 + int(w), y0 + int(h)))
        labels = labels[:len(boxes)].astype(np.int64)
        image = np.zeros((s, s, 3), np.uint8)
        masks = np.zeros((len(boxes), s, s), np.uint8)
        mask = np.zeros((s, s), self.mask_dtype)
        for k, ((x0, y0, x1, y1), label) in enumerate(zip(boxes, labels)):
            image[y0:y1, x0:x1] = PALETTE[label]
            masks[k, y0:y1, x0:x1] = 1
            mask[y0:y1, x0:x1] = label + 1
        box_array = np.array(boxes, np.float32).reshape(-1, 4)
        x0, y0, x1, y1 = box_array.T
        corners = np.stack([np.stack([x0, y0], -1), np.stack([x1, y0], -1), np.stack([x1, y1], -1),
                            np.stack([x0, y1], -1)], 1)
        keypoints = np.concatenate([corners, np.full((len(boxes), 4, 1), 2, np.float32)], -1).astype(np.float32)
        return {
            "image": image, "boxes": box_array, "labels": labels, "masks": masks, "mask": mask,
            "iscrowd": np.zeros(len(boxes), np.int64),
            "area": ((box_array[:, 2] - box_array[:, 0]) * (box_array[:, 3] - box_array[:, 1])).astype(np.float32),
            "ids": i * 100 + np.arange(len(boxes), dtype=np.int64), "keypoints": keypoints.reshape(-1, 4, 3),
            "name": f"rect-{i}", "label": len(boxes),
        }


class Mixed:
    """Fields of every kind: image uint8 [8, 8, 3] (or [8 + i % 3, 8, 3] with ``ragged_images``),
    label int, weight float, flag bool, name str, raw bytes, vec float32 [3], boxes float32 [i % 3, 4] (inside the
    image, x_min < x_max),
    torch tensor ``t`` (float32 [2]) when torch imports, and ``odd`` int in even samples and float
    in odd ones when ``mixed_dtype``. ``only``: keep these fields alone. Sample ``fail_at`` raises
    ZeroDivisionError in ``_broken``. Sample ``drift_at`` has a field of another type than the
    others: ``drift`` "label" (a str label), "image" (a float64 image) or "rank" (vec [1, 3])."""

    def __init__(self, n: int = 12, ragged_images: bool = False, mixed_dtype: bool = False, fail_at: int = -1,
                 only: list | None = None, drift_at: int = -1, drift: str = "label"):
        self.n, self.ragged_images, self.mixed_dtype, self.fail_at = n, ragged_images, mixed_dtype, fail_at
        self.only, self.drift_at, self.drift = only, drift_at, drift

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        if i == self.fail_at:
            return self._broken(i)
        h = 8 + i % 3 if self.ragged_images else 8
        image = np.full((h, 8, 3), i % 256, np.uint8)
        sample = {
            "image": image, "label": i % 4, "weight": i / 4, "flag": i % 2 == 0, "name": f"sample-{i}-é",
            "raw": bytes(range(i % 5)), "vec": np.arange(3, dtype=np.float32) + i,
            "boxes": np.array([[0, 1, 2, 3], [1, 2, 5, 7]], np.float32)[:i % 3] + i % 2,
        }
        if self.only is None or "t" in self.only:
            try:
                import torch
                sample["t"] = torch.tensor([i, -i], dtype=torch.float32)
            except ImportError:
                pass
        if self.mixed_dtype:
            sample["odd"] = i if i % 2 == 0 else float(i)
        if i == self.drift_at:
            sample.update({"label": {"label": "cat"}, "image": {"image": image.astype(np.float64)},
                           "rank": {"vec": sample["vec"][None]}}[self.drift])
        return sample if self.only is None else {k: v for k, v in sample.items() if k in self.only}

    def _broken(self, i: int) -> dict:
        ratio = i / (self.fail_at - i)  # ZeroDivisionError: the user's own line
        return {"image": np.zeros((8, 8, 3), np.uint8), "ratio": ratio}


class Declared(Mixed):
    """Mixed with its fields declared (``fields``) instead of read from sample 0."""

    fields = {"image": ("uint8", (8, 8, 3)), "label": ("int64", ()), "weight": ("float64", ()), "flag": ("bool", ()),
              "name": ("str", ()), "raw": ("bytes", ()), "vec": ("float32", (3,)),
              "boxes": {"dtype": "float32", "shape": (-1, 4)}, "t": ("float32", (2,))}


class Versioned(Mixed):
    """Mixed, with a ``fingerprint()`` naming the data version."""

    def __init__(self, version: str = "v1", **kw):
        super().__init__(**kw)
        self.version = version

    def fingerprint(self) -> str:
        return self.version


class Paced:
    """Sample i: image uint8 [4, 4] filled with i % 256, label i. Reading it takes ``seconds``, and
    ``stall_seconds`` for sample ``stall_at``: batches come at a steady pace but one, which a stream
    waits for while the workers build the batches after it (tests/serve/test_shutdown_batches.py)."""

    def __init__(self, n: int = 2000, seconds: float = 0.0, stall_at: int = -1, stall_seconds: float = 0.0):
        self.n, self.seconds, self.stall_at, self.stall_seconds = n, seconds, stall_at, stall_seconds

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        if not 0 <= i < self.n:
            raise IndexError(i)
        time.sleep(self.stall_seconds if i == self.stall_at else self.seconds)
        return {"image": np.full((4, 4), i % 256, np.uint8), "label": i}


class WeightedPaced(Paced):
    """Paced with weights of its own, for weighted sampling (``weights``: sample i weighs i % 5, so
    every fifth weighs 0); ``bad``: one weight too few (the server refuses it at start)."""

    def __init__(self, n: int = 50, bad: bool = False):
        super().__init__(n)
        self.weights = (np.arange(n - 1 if bad else n) % 5).astype(np.float64)


def _pattern(i: int, size: int) -> np.ndarray:
    """uint8 [size, size, 3]: every pixel different (so a flip or a transpose shows), shifted by i."""
    return ((np.arange(size * size * 3).reshape(size, size, 3) * 7 + i) % 251).astype(np.uint8)


class TutorialFlips:
    """Augments in __getitem__ with the global generators, as torchvision's detection tutorial does
    (``if random.random() < 0.5: flip``): a horizontal flip by Python's ``random``, a vertical one
    by ``numpy.random`` and a transpose by ``torch.rand`` (when ``use_torch``). Sample i: image
    uint8 [size, size, 3] (``_pattern(i)`` after the flips), ``flips`` uint8 [3] (which were
    applied), ``noise`` float64 (``np.random.normal()``), label int (i % 3)."""

    def __init__(self, n: int = 600, size: int = 6, use_torch: bool = True):
        self.n, self.size, self.use_torch = n, size, use_torch
        if use_torch:
            import torch  # noqa: F401  (as the tutorial does, at import time)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        if not 0 <= i < self.n:
            raise IndexError(i)
        image = _pattern(i, self.size)
        by_random = random.random() < 0.5
        by_numpy = bool(np.random.rand() < 0.5)
        by_torch = False
        if self.use_torch:
            import torch

            by_torch = bool(torch.rand(()) < 0.5)
        if by_random:
            image = image[:, ::-1]
        if by_numpy:
            image = image[::-1]
        if by_torch:
            image = image.transpose(1, 0, 2)
        return {"image": np.ascontiguousarray(image), "flips": np.array([by_random, by_numpy, by_torch], np.uint8),
                "noise": float(np.random.normal()), "label": i % 3}


class RngFlips:
    """Takes the sample's own generator, as grain hands a random map its rng: ``__getitem__(i,
    rng=None)`` flips horizontally if ``rng.random() < 0.5`` and vertically if the next draw is
    (``numpy.random`` when called without one, as a plain DataLoader does). Fields as
    TutorialFlips' (``flips`` uint8 [2])."""

    def __init__(self, n: int = 600, size: int = 6):
        self.n, self.size = n, size

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int, rng: np.random.Generator | None = None) -> dict:
        rng = np.random.default_rng() if rng is None else rng
        image = _pattern(i, self.size)
        h, v = rng.random() < 0.5, rng.random() < 0.5
        if h:
            image = image[:, ::-1]
        if v:
            image = image[::-1]
        return {"image": np.ascontiguousarray(image), "flips": np.array([h, v], np.uint8), "label": i % 3}


class OwnGenerator(RngFlips):
    """Draws its flips from a generator made in __init__ (``self.rng``): randomness batchd cannot key."""

    def __init__(self, n: int = 40, size: int = 6):
        super().__init__(n, size)
        self.rng = np.random.default_rng()

    def __getitem__(self, i: int) -> dict:
        return super().__getitem__(i, self.rng)


class OwnCompose(RngFlips):
    """An albumentations Compose made in __init__ (its own generators) run in __getitem__."""

    def __init__(self, n: int = 40, size: int = 6):
        import albumentations as A

        super().__init__(n, size)
        self.transform = A.Compose([A.HorizontalFlip(p=0.5)])

    def __getitem__(self, i: int) -> dict:
        return {"image": self.transform(image=_pattern(i, self.size))["image"], "label": i % 3}


class Urandom(RngFlips):
    """Noise from the operating system in every sample: no generator to find, two builds differ."""

    def __getitem__(self, i: int) -> dict:
        import os

        return {"image": np.frombuffer(os.urandom(self.size * self.size * 3), np.uint8).reshape(self.size, self.size, 3),
                "label": i % 3}


class BadField:
    """Sample ``at`` has a field ``extra`` that cannot become an array: ``what`` is "dict", "object",
    "list", "none" or "bfloat16" (a torch tensor numpy cannot hold); the other samples have
    ``extra`` float32 [2]. image uint8 [4, 4, 3] filled with i, label i."""

    def __init__(self, n: int = 12, at: int = 5, what: str = "dict"):
        self.n, self.at, self.what = n, at, what

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        extra: object = np.array([i, -i], np.float32)
        if i == self.at:
            if self.what == "bfloat16":
                import torch

                extra = torch.tensor([1.0, 2.0], dtype=torch.bfloat16)
            else:
                extra = {"dict": {"a": 1}, "object": object(), "list": [1, 2], "none": None}[self.what]
        return {"image": np.full((4, 4, 3), i % 256, np.uint8), "label": i, "extra": extra}


class Boxes:
    """Sample i: image uint8 [size, size, 3] filled with i, ``boxes`` (a list of [x_min, y_min,
    x_max, y_max] pixels) as ``dtype``, labels int64 [N], ``keypoints`` as ``dtype`` [N, 2, 3]
    (each box's top-left and bottom-right corners, visibility 2); with ``guide``, ``cropping_bbox``
    float32 [4] (box i % N, for RandomCropNearBBox). At index ``bad_at`` the field ``bad_field``
    is ``np.array(bad, dtype)`` instead (any nested list; NaN allowed)."""

    def __init__(self, n: int = 8, size: int = 10, boxes: list | None = None, dtype: str = "int64", bad_at: int = -1,
                 bad_field: str = "boxes", bad: list | None = None, guide: bool = False):
        self.n, self.size, self.dtype, self.guide = n, size, np.dtype(dtype), guide
        self.boxes = np.array(boxes if boxes is not None else [[0, 1, 6, 8], [2, 2, 9, 9]], self.dtype).reshape(-1, 4)
        self.bad_at, self.bad_field, self.bad = bad_at, bad_field, bad

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        boxes = self.boxes
        corners = np.stack([boxes[:, :2], boxes[:, 2:]], 1)
        keypoints = np.concatenate([corners, np.full((len(boxes), 2, 1), 2, self.dtype)], -1)
        sample = {"image": np.full((self.size, self.size, 3), i % 256, np.uint8), "boxes": boxes,
                  "labels": np.arange(len(boxes), dtype=np.int64), "keypoints": keypoints}
        if self.guide:
            sample["cropping_bbox"] = boxes[i % len(boxes)].astype(np.float32)
        if i == self.bad_at:
            sample[self.bad_field] = np.array(self.bad, self.dtype if self.bad_field != "labels" else np.int64)
        return sample


class Given:
    """One sample, as the arguments say: image uint8 [h, w, 3] of noise (from ``seed``), boxes
    ``np.array(boxes, box_dtype)`` [N, 4], labels int64 [N] (10, 11, ...), keypoints of
    ``box_dtype`` [N, 2, 3] (each box's top-left and bottom-right corners, visibility 2), and
    ``extra`` fields: name -> [kind, value], kind "int", "float", "bool", "str", "bytes" (a list of
    ints) or a numpy dtype name (value: a nested list)."""

    def __init__(self, h: int, w: int, seed: int, boxes: list, box_dtype: str, extra: dict | None = None):
        self.h, self.w, self.seed, self.extra = h, w, seed, extra or {}
        self.boxes = np.array(boxes, np.dtype(box_dtype)).reshape(-1, 4)

    def __len__(self) -> int:
        return 1

    def __getitem__(self, i: int) -> dict:
        if i != 0:
            raise IndexError(i)
        boxes = self.boxes
        corners = np.stack([boxes[:, :2], boxes[:, 2:]], 1)
        sample = {"image": np.random.default_rng(self.seed).integers(0, 256, (self.h, self.w, 3), np.uint8),
                  "boxes": boxes, "labels": 10 + np.arange(len(boxes), dtype=np.int64),
                  "keypoints": np.concatenate([corners, np.full((len(boxes), 2, 1), 2, boxes.dtype)], -1)}
        for name, (kind, value) in self.extra.items():
            sample[name] = {"int": int, "float": float, "bool": bool, "str": str, "bytes": bytes}.get(
                kind, lambda v: np.array(v, np.dtype(kind)))(value)
        return sample


MODULE_NUMPY = np.random.default_rng()  # module-level generators a dataset may draw from (Unkeyable)
MODULE_RANDOM = random.Random()
MODULE_TORCH = None  # a torch.Generator, made on first use (torch imports lazily here)


def _closure_draw():
    rng = np.random.default_rng()
    return lambda: float(rng.random())


class Unkeyable(RngFlips):
    """Draws one number per sample from ``source``, a generator batchd cannot key, and flips odd
    samples by it (sample 0 never changes: a check of sample 0's bytes alone passes it):
    "default_rng" (``np.random.default_rng()`` made in __getitem__), "random_instance"
    (``random.Random()`` made in __getitem__), "random_seed" (``random.seed()`` then
    ``random.random()``), "module_numpy", "module_random", "module_torch" (generators at module
    level), "closure" (a generator in the closure of a function the dataset holds). Only after
    ``after`` calls of __getitem__ (before: no draw at all)."""

    def __init__(self, n: int = 40, size: int = 6, source: str = "default_rng", after: int = 0):
        super().__init__(n, size)
        self.source, self.after, self.calls = source, after, 0
        self.draw = _closure_draw()

    def _draw(self) -> float:
        global MODULE_TORCH
        if self.source == "default_rng":
            return float(np.random.default_rng().random())
        if self.source == "random_instance":
            return random.Random().random()
        if self.source == "random_seed":
            random.seed()
            return random.random()
        if self.source == "module_numpy":
            return float(MODULE_NUMPY.random())
        if self.source == "module_random":
            return MODULE_RANDOM.random()
        if self.source == "module_torch":
            import torch

            MODULE_TORCH = MODULE_TORCH or torch.Generator()
            return float(torch.rand((), generator=MODULE_TORCH))
        return self.draw()

    def __getitem__(self, i: int) -> dict:
        self.calls += 1
        flip = self.calls > self.after and self._draw() < 0.5 and i % 2 == 1
        image = _pattern(i, self.size)
        return {"image": np.ascontiguousarray(image[:, ::-1] if flip else image), "label": i % 3}


class SeededCompose(RngFlips):
    """The remedy the refusal recommends: an albumentations Compose made in __init__, reseeded
    in __getitem__ from the sample's own ``rng`` (``compose.set_random_seed``); with ``declare``,
    its fields declared (``fields``); with ``build_in_getitem``, the Compose made in __getitem__
    with a seed drawn from ``rng`` instead (albumentations seeds a new transform from the OS first)."""

    def __init__(self, n: int = 40, size: int = 6, declare: bool = False, build_in_getitem: bool = False):
        import albumentations as A

        super().__init__(n, size)
        self.build_in_getitem = build_in_getitem
        self.transform = A.Compose([A.HorizontalFlip(p=0.5), A.VerticalFlip(p=0.5)])
        if declare:
            self.fields = {"image": ("uint8", (size, size, 3)), "label": ("int64", ())}

    def __getitem__(self, i: int, rng: np.random.Generator | None = None) -> dict:
        import albumentations as A

        rng = np.random.default_rng(i) if rng is None else rng
        seed = int(rng.integers(2**32))
        if self.build_in_getitem:
            transform = A.Compose([A.HorizontalFlip(p=0.5), A.VerticalFlip(p=0.5)], seed=seed)
        else:
            transform = self.transform
            transform.set_random_seed(seed)
        return {"image": transform(image=_pattern(i, self.size))["image"], "label": i % 3}


def global_draws():
    """A python pipeline drawing from the global generators, as torchvision transforms inside a
    preset do: ``draws`` float64 [3] from ``random.random()``, ``np.random.rand()`` and
    ``torch.rand()``, and the image flipped when the first is below 1/2."""

    def fn(sample: dict, rng: np.random.Generator) -> dict:
        import torch

        draws = np.array([random.random(), np.random.rand(), float(torch.rand(()))])
        image = sample["image"][:, ::-1] if draws[0] < 0.5 else sample["image"]
        return {**sample, "image": np.ascontiguousarray(image), "draws": draws}

    return fn


def build_failing(**args):
    raise RuntimeError(f"cannot open the data: {args}")


def jitter(scale: float = 10.0):
    """A python pipeline: adds rng.normal(0, scale) to a new float field ``noise`` and inverts the
    image with probability 1/2, drawing from the sample's own stream."""

    def fn(sample: dict, rng: np.random.Generator) -> dict:
        out = dict(sample)
        out["noise"] = float(rng.normal(0.0, scale))
        if rng.random() < 0.5:
            out["image"] = 255 - sample["image"]
        return out

    return fn


def dict_field_at(label: int = 5, key: str = "label"):
    """A python pipeline that adds a field ``note``: a dict (which cannot become an array) in the
    sample whose field ``key`` has ``label`` for its largest value, an int elsewhere. ``key``: a
    scalar (``label``, coco's ``image_id``) or an array (a segmentation's ``mask``)."""

    def fn(sample: dict, rng: np.random.Generator) -> dict:
        return {**sample, "note": {"label": label} if int(np.max(sample[key])) == label else 0}

    return fn


def paced(seconds: float = 0.01):
    """A python pipeline that sleeps ``seconds`` per sample and returns it unchanged: a server
    whose speed its config sets (one worker: 1 / (seconds x batch_size) batches per second) while
    the bytes stay those of any other server, and the CPU stays free (2 cores run several)."""

    def fn(sample: dict, rng: np.random.Generator) -> dict:
        time.sleep(seconds)
        return sample

    return fn
