"""``kind: segmentation`` end to end: ``batchd.RemoteDataLoader`` against a real server over the
generated VOC-style data (examples/make_fashion_coco.py: JPEG canvases, palette PNG masks of
class indices with 255 on item borders), with a random flip and crop.

The image and its mask must move together. Two oracles: the pixels themselves (flips and crops
are exact, so each served image is found, by exact search, as a crop of the decoded JPEG or of
its mirror image, and the served mask must be the same crop of the PNG's indices, mirrored alike);
and albumentations itself running the pipeline in this process under the sample's own stream.
"""

from __future__ import annotations

import albumentations as A
import cv2
import numpy as np
import pytest
from PIL import Image

import batchd
from batchd.sampler import sample_key
from batchd.server.compute.pipeline import SampleRandom

pytestmark = pytest.mark.timeout(120)

SIDE, SEED, EPOCH = 64, 3, 2
FLIP_CROP = A.Compose([A.HorizontalFlip(p=0.5), A.RandomCrop(SIDE, SIDE)])


def originals(root, split: str = "train") -> list[tuple[np.ndarray, np.ndarray]]:
    """(image RGB uint8 [H, W, 3] as OpenCV decodes the JPEG, mask uint8 [H, W] of palette indices
    as Pillow reads the PNG) of every sample, sorted by stem (the kind's order)."""
    out = []
    for path in sorted((root / "images" / split).glob("*.jpg")):
        image = cv2.cvtColor(cv2.imread(str(path)), cv2.COLOR_BGR2RGB)
        with Image.open(root / "masks" / split / f"{path.stem}.png") as png:
            assert png.mode == "P"
            out.append((image, np.array(png)))
    return out


def where(crop: np.ndarray, image: np.ndarray) -> list[tuple[bool, int, int]]:
    """Every (mirrored, y, x) at which ``crop`` is exactly ``image[y:y+h, x:x+w]`` (of ``image``
    mirrored left to right when mirrored)."""
    found = []
    for mirrored in (False, True):
        source = image[:, ::-1] if mirrored else image
        sqdiff = cv2.matchTemplate(np.ascontiguousarray(source), crop, cv2.TM_SQDIFF)  # float32: 0 only roughly
        for y, x in zip(*np.unravel_index(np.argsort(sqdiff, axis=None)[:4], sqdiff.shape)):  # the 4 best, checked
            if np.array_equal(source[y:y + SIDE, x:x + SIDE], crop):
                found.append((mirrored, int(y), int(x)))
    return found


@pytest.fixture(scope="module")
def served(fashion_coco, tmp_path_factory):
    """(index, position, image, mask) of every sample of a shuffled epoch through FLIP_CROP."""
    from conftest import running_server

    datasets = {"voc": {"kind": "segmentation", "images": str(fashion_coco / "images" / "train"),
                        "masks": str(fashion_coco / "masks" / "train")}}
    with running_server(workers=2, cache_dir=tmp_path_factory.mktemp("seg"), datasets=datasets) as server:
        with batchd.RemoteDataLoader(server.address, "voc", batch_size=8, shuffle=True, seed=SEED,
                                     transform=FLIP_CROP) as loader:
            loader.set_epoch(EPOCH)
            out = []
            for batch in loader:
                assert batch["image"].shape[1:] == (SIDE, SIDE, 3) and batch["mask"].shape[1:] == (SIDE, SIDE)
                for j, (i, p) in enumerate(zip(batch["index"].tolist(), batch["position"].tolist())):
                    out.append((i, p, batch["image"][j].numpy().copy(), batch["mask"][j].numpy().copy()))
    return out


def test_the_mask_is_cropped_and_flipped_with_its_image(served, fashion_coco):
    data = originals(fashion_coco)
    assert sorted(i for i, *_ in served) == list(range(len(data)))
    mirrored, offsets = 0, set()
    for index, _, image, mask in served:
        original, original_mask = data[index]
        places = where(image, original)
        assert len(places) == 1, f"sample {index}: the served image is found at {places} in its JPEG"
        flip, y, x = places[0]
        source = original_mask[:, ::-1] if flip else original_mask
        assert np.array_equal(mask, source[y:y + SIDE, x:x + SIDE]), \
            f"sample {index}: the mask was not cropped at ({y}, {x}){' and mirrored' if flip else ''} with its image"
        mirrored += flip
        offsets.add((y, x))
    # the draws vary (each sample's own stream): both ways of flipping, many crop offsets
    assert 0.25 * len(served) < mirrored < 0.75 * len(served) and len(offsets) > 0.8 * len(served)
    assert any((m == 255).any() for *_, m in served) and any(((m > 0) & (m < 255)).any() for *_, m in served)


def test_each_sample_is_what_albumentations_gives_under_its_stream(served, fashion_coco):
    data = originals(fashion_coco)
    rnd = SampleRandom()
    compose = A.from_dict(A.to_dict(FLIP_CROP))
    rnd.attach(compose)
    key = sample_key(seed=SEED, epoch=EPOCH)
    for index, position, image, mask in served:
        rnd.start(key, position)
        want = compose(image=data[index][0], mask=data[index][1])
        assert np.array_equal(image, want["image"]) and np.array_equal(mask, want["mask"]), index
        assert mask.dtype == np.uint8
