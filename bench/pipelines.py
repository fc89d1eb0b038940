"""The benchmark pipelines L1-L4 (albumentations), as objects and as ``A.to_dict`` presets."""

from __future__ import annotations

import json

import albumentations as A

NAMES = ("L1", "L2", "L3", "L4")

DESCRIPTIONS = {
    "L1": "Resize(256,256) + RandomCrop(200,200)",
    "L2": "L1 + HorizontalFlip + VerticalFlip",
    "L3": "Resize, HorizontalFlip, RandomCrop(200,200), RandomBrightnessContrast, VerticalFlip",
    "L4": "L3 + Rotate(limit=15) + HueSaturationValue + GaussianBlur",
}


def transforms(name: str) -> list:
    """The transforms of pipeline ``name`` (every one with p=1)."""
    l1 = [A.Resize(256, 256), A.RandomCrop(200, 200)]
    l3 = [
        A.Resize(256, 256),
        A.HorizontalFlip(p=1),
        A.RandomCrop(200, 200),
        A.RandomBrightnessContrast(p=1),
        A.VerticalFlip(p=1),
    ]
    if name == "L1":
        return l1
    if name == "L2":
        return l1 + [A.HorizontalFlip(p=1), A.VerticalFlip(p=1)]
    if name == "L3":
        return l3
    if name == "L4":
        return l3 + [A.Rotate(limit=15, p=1), A.HueSaturationValue(p=1), A.GaussianBlur(p=1)]
    raise KeyError(f"unknown pipeline {name!r}; expected one of {NAMES}")


def build(name: str) -> A.Compose:
    return A.Compose(transforms(name))


def preset(name: str) -> dict:
    """``A.to_dict(build(name))`` as plain JSON types (for a YAML config)."""
    return json.loads(json.dumps(A.to_dict(build(name))))


def presets(names=NAMES) -> dict[str, dict]:
    return {n: preset(n) for n in names}
