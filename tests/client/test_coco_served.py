"""``kind: coco`` end to end, as a user runs it: ``batchd.RemoteDataLoader`` against real servers
over the generated Fashion-COCO data (``masks: true``), with a train pipeline that carries
``bbox_params`` (random resized crop, flip, colour), and without a pipeline.

Oracles: pycocotools' reading of the JSON in torchvision's order (tests/coco_oracle.py); the
pipeline run by albumentations itself, in this process, on the oracle's sample under the sample's
own random stream (``sample_key(seed, epoch)``, the batch's ``position``); torch's ``DataLoader``
for ``batchd.detection_collate``. The invariant: the same bytes with 1 and 2 workers, after exact
resume on a fresh server, over shared memory and TCP, and through two servers.
"""

from __future__ import annotations

import json

import albumentations as A
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import batchd
import coco_oracle
from batchd.sampler import sample_key
from batchd.server.compute.pipeline import SampleRandom
from conftest import running_server
from helpers import fields_digest

pytestmark = pytest.mark.timeout(120)

PER_OBJECT = ("boxes", "labels", "iscrowd", "area", "masks")
MIN_VISIBILITY = 0.2
TRAIN = A.Compose([A.RandomResizedCrop(size=(64, 64), scale=(0.2, 1.0)), A.HorizontalFlip(p=0.5),
                   A.RandomBrightnessContrast(p=0.5)],
                  bbox_params=A.BboxParams(format="pascal_voc", label_fields=["labels"], min_visibility=MIN_VISIBILITY))
B, SEED, EPOCH = 8, 7, 1


def coco_config(root) -> dict:
    return {"det": {"kind": "coco", "images": str(root / "images" / "train"),
                    "annotations": str(root / "annotations" / "instances_train.json"), "masks": True}}


@pytest.fixture(scope="module")
def oracle(fashion_coco) -> list[dict]:
    """Sample i of the train split as pycocotools reads it (torchvision's order), image included."""
    return coco_oracle.samples(fashion_coco / "annotations" / "instances_train.json", fashion_coco / "images" / "train")


@pytest.fixture(scope="module")
def servers(fashion_coco, tmp_path_factory):
    """Two servers on the train split: 2 workers and 1 worker."""
    cache = tmp_path_factory.mktemp("coco-served")
    with running_server(workers=2, cache_dir=cache, datasets=coco_config(fashion_coco)) as two, \
            running_server(workers=1, cache_dir=cache, datasets=coco_config(fashion_coco)) as one:
        yield two, one


def loader(address, **kw) -> batchd.RemoteDataLoader:
    kw = {"batch_size": B, "shuffle": True, "seed": SEED, "transform": TRAIN, **kw}
    ld = batchd.RemoteDataLoader(address, "det", timeout=60, **kw)
    ld.set_epoch(EPOCH)
    return ld


def epoch_digests(address, **kw) -> list[str]:
    with loader(address, **kw) as ld:
        return [fields_digest(b) for b in ld]


@pytest.fixture(scope="module")
def reference(servers) -> list[str]:
    """The train epoch's batch digests from the 2-worker server over shared memory."""
    return epoch_digests(servers[0].address, transport="shm")


def augmented(sample: dict, position: int) -> dict:
    """``sample`` (the oracle's) through TRAIN as albumentations itself gives it under the sample's
    stream: the Compose with an object number as its only label field; every per-object field
    then takes the surviving objects, in the surviving boxes' order."""
    spec = A.to_dict(TRAIN)
    compose = A.Compose(A.from_dict(spec).transforms, bbox_params=A.BboxParams(
        format="pascal_voc", label_fields=["objects"], min_visibility=MIN_VISIBILITY, min_width=0.01, min_height=0.01))
    rnd = SampleRandom()
    rnd.attach(compose)
    rnd.start(sample_key(seed=SEED, epoch=EPOCH), position)
    n = len(sample["boxes"])
    targets = {"masks": sample["masks"]} if n else {}  # albumentations cannot stack no masks
    out = compose(image=sample["image"], bboxes=sample["boxes"], objects=np.arange(n), **targets)
    kept = np.asarray(out["objects"], np.int64)
    masks = np.asarray(out["masks"], np.uint8)[kept] if n else np.zeros((0, 64, 64), np.uint8)
    return {"image": out["image"], "boxes": np.asarray(out["bboxes"], np.float32).reshape(-1, 4),
            "labels": sample["labels"][kept], "iscrowd": sample["iscrowd"][kept], "area": sample["area"][kept],
            "masks": masks.reshape(-1, 64, 64), "image_id": sample["image_id"]}


def test_ragged_batches_are_aligned_lists_equal_to_albumentations_under_the_samples_stream(servers, oracle):
    """A train epoch: image stacked [B, 64, 64, 3], image_id stacked int64 [B], every per-object
    field a list of B tensors whose N agree sample by sample (0 included), each sample equal to the
    pipeline run in-process on pycocotools' sample; every mask lies inside its box."""
    counts, seen = [], []
    with loader(servers[0].address) as ld:
        for batch in ld:
            b = len(batch["index"])
            assert batch["image"].shape == (b, 64, 64, 3) and batch["image"].dtype == torch.uint8
            assert batch["image_id"].shape == (b,) and batch["image_id"].dtype == torch.int64
            assert all(isinstance(batch[f], list) and len(batch[f]) == b for f in PER_OBJECT), \
                {f: type(batch[f]).__name__ for f in PER_OBJECT}
            for j, (index, position) in enumerate(zip(batch["index"].tolist(), batch["position"].tolist())):
                seen.append(index)
                want = augmented(oracle[index], position)
                n = len(want["boxes"])
                counts.append(n)
                for name, value in want.items():
                    got = batch[name][j]
                    assert got.dtype == torch.from_numpy(np.asarray(value)).dtype, (index, name, got.dtype)
                    assert got.shape == np.asarray(value).shape, (index, name, tuple(got.shape))
                    np.testing.assert_array_equal(got.numpy(), value, err_msg=f"sample {index} field {name}")
                for box, mask in zip(batch["boxes"][j], batch["masks"][j]):  # an independent look at the geometry
                    ys, xs = np.nonzero(mask.numpy())
                    if len(xs):
                        x0, y0, x1, y1 = box.tolist()
                        assert x0 - 1 <= xs.min() and xs.max() + 1 <= x1 + 1 and y0 - 1 <= ys.min() and \
                            ys.max() + 1 <= y1 + 1, (index, box, xs.min(), xs.max(), ys.min(), ys.max())
    assert sorted(seen) == list(range(len(oracle)))
    assert counts.count(0) >= 3 and max(counts) >= 4, counts  # N varies, and N = 0 is among them
    original = [len(s["boxes"]) for s in oracle]
    assert sum(counts) < sum(original), "the crop under min_visibility dropped no object: a test of nothing"


def test_same_bytes_with_one_and_two_workers_and_over_tcp(servers, reference):
    two, one = servers
    assert len(reference) == 8
    assert epoch_digests(one.address, transport="shm") == reference, "1 worker gave other bytes than 2"
    assert epoch_digests(two.address, transport="inline") == reference, "TCP gave other bytes than shared memory"
    assert epoch_digests(two.address, transport="inline", compression="lz4") == reference


def test_same_bytes_through_two_servers(servers, reference):
    two, one = servers
    built = one.loader.pool.batches_built
    assert epoch_digests([two.address, one.address]) == reference
    assert one.loader.pool.batches_built > built, "the second server built nothing"


def test_exact_resume_on_a_fresh_server(servers, reference, make_server, fashion_coco):
    k = 3
    with loader(servers[0].address) as ld:
        it = iter(ld)
        first = [fields_digest(next(it)) for _ in range(k)]
        state = json.loads(json.dumps(ld.state_dict()))
    assert first == reference[:k] and (state["epoch"], state["next_batch"]) == (EPOCH, k)
    fresh = make_server(workers=2, datasets=coco_config(fashion_coco))
    with batchd.RemoteDataLoader(fresh.address, "det", batch_size=B, shuffle=True, seed=SEED, transform=TRAIN) as ld:
        ld.load_state_dict(state)
        rest = [fields_digest(b) for b in ld]
    assert rest == reference[k:]
    assert fresh.loader.pool.batches_built == len(reference) - k, "the resumed epoch computed batches before k"


def test_without_a_pipeline_every_field_is_pycocotools_reading_in_torchvisions_order(servers, oracle):
    with batchd.RemoteDataLoader(servers[0].address, "det", batch_size=B, transport="shm") as ld:
        batches = list(ld)
    got = [{name: value[j] for name, value in b.items()} for b in batches for j in range(len(b["index"]))]
    assert [int(s["index"]) for s in got] == list(range(len(oracle)))
    assert isinstance(batches[0]["image"], list), "images of different sizes must come as a list"
    for i, (s, want) in enumerate(zip(got, oracle)):
        assert set(s) == set(want) | {"index", "position"}
        for name, value in want.items():
            value = np.asarray(value)
            assert s[name].dtype == torch.from_numpy(value).dtype and s[name].shape == value.shape, (i, name)
            np.testing.assert_array_equal(s[name].numpy(), value, err_msg=f"sample {i} field {name}")


class ImageTarget(Dataset):
    """The oracle's samples as torchvision's detection references' datasets give them: (image,
    target), the target a dict of tensors (with the loader's ``index`` and ``position``)."""

    def __init__(self, oracle: list[dict]):
        self.oracle = oracle

    def __len__(self) -> int:
        return len(self.oracle)

    def __getitem__(self, i: int):
        s = self.oracle[i]
        target = {"index": torch.tensor(i), "position": torch.tensor(i)}
        target.update({k: torch.as_tensor(np.asarray(v)) for k, v in s.items() if k != "image"})
        return torch.from_numpy(s["image"]), target


def test_detection_collate_gives_what_dataloader_gives_over_image_target_pairs(servers, oracle):
    from test_collate_fn import assert_same

    want = list(DataLoader(ImageTarget(oracle), batch_size=B, collate_fn=lambda x: tuple(zip(*x))))
    with batchd.RemoteDataLoader(servers[0].address, "det", batch_size=B,
                                 collate_fn=batchd.detection_collate) as ld:
        got = list(ld)
    assert_same(got, want)
    images, targets = got[0]
    assert len(images) == len(targets) == B and list(targets[0]) == \
        ["index", "position", "boxes", "labels", "iscrowd", "area", "image_id", "masks"]
