"""The ``webdataset`` kind: tar shards in WebDataset's layout, checked against the ``webdataset``
package itself reading the same shards, locally and on a real S3 server (SeaweedFS)."""

from __future__ import annotations

import io
import json
import os
import tarfile

import cv2
import numpy as np
import pytest

import batchd
from batchd.errors import SampleError
from batchd.sampler import shard_indices
from batchd.server.config import WebDatasetConfig
from batchd.server.data.datasets import open_dataset
from helpers import digest
from seaweed import seaweed  # noqa: F401  (the session fixture)

pytestmark = pytest.mark.timeout(300)

N_SHARDS, PER_SHARD = 3, 7


def _png(seed: int) -> bytes:
    rgb = np.random.default_rng(seed).integers(0, 256, (12, 16, 3), dtype=np.uint8)
    return cv2.imencode(".png", cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR))[1].tobytes()


def _jpg(seed: int) -> bytes:
    rgb = np.random.default_rng(seed).integers(0, 256, (12, 16, 3), dtype=np.uint8)
    return cv2.imencode(".jpg", cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR))[1].tobytes()


def write_shards(folder, *, json_labels: bool = False) -> list[str]:
    """Shards ``train-000000.tar``... written by webdataset.TarWriter: per sample an image (PNG or
    JPEG), its label (``.cls``, or ``.json`` {"label": ...}) and a caption that is ignored."""
    import webdataset as wds

    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for s in range(N_SHARDS):
        path = folder / f"train-{s:06d}.tar"
        with wds.TarWriter(str(path)) as sink:
            for i in range(PER_SHARD):
                n = s * PER_SHARD + i
                sample = {"__key__": f"{n:06d}", "txt": f"caption {n}"}
                sample["jpg" if n % 3 == 0 else "png"] = _jpg(n) if n % 3 == 0 else _png(n)
                if json_labels:
                    sample["json"] = {"label": ["bird", "ant", "cow"][n % 3], "extra": n}
                else:
                    sample["cls"] = n % 4
                sink.write(sample)
        paths.append(str(path))
    return paths


def reference(urls: list[str], label_field: str = "label") -> list[tuple[str, bytes, object]]:
    """(key, image bytes, label) of every sample, in order, as the webdataset package reads them."""
    import webdataset as wds

    out = []
    for sample in wds.WebDataset(urls, shardshuffle=False, empty_check=False):
        image = sample.get("jpg", sample.get("png"))
        label = int(sample["cls"]) if "cls" in sample else json.loads(sample["json"])[label_field]
        out.append((sample["__key__"], bytes(image), label))
    return out


def ours(ds) -> list[tuple[str, bytes, object]]:
    return [(ds.key(i), bytes(ds.read_bytes(i)), ds.classes[ds.label(i)]) for i in range(len(ds))]


def test_same_samples_as_the_webdataset_package(tmp_path):
    paths = write_shards(tmp_path / "shards")
    pattern = str(tmp_path / "shards" / "train-{000000..000002}.tar")
    ds = open_dataset("wds", WebDatasetConfig(kind="webdataset", shards=pattern), tmp_path / "cache", build=True)
    want = reference(paths)
    assert len(ds) == len(want) == N_SHARDS * PER_SHARD
    assert [(k, b, str(l)) for k, b, l in want] == ours(ds)  # same keys, bytes, labels, order
    assert ds.classes == ["0", "1", "2", "3"]
    assert ds.source(8) == f"{paths[1]}#000008"
    img = ds.load_image(4)
    assert img.shape == (12, 16, 3) and img.dtype == np.uint8
    # a list of the same shards is the same dataset
    listed = open_dataset("wds", WebDatasetConfig(kind="webdataset", shards=tuple(paths)), tmp_path / "cache2", build=True)
    assert listed.fingerprint == ds.fingerprint and ours(listed) == ours(ds)


def test_json_string_labels(tmp_path):
    paths = write_shards(tmp_path / "shards", json_labels=True)
    ds = open_dataset("wds", WebDatasetConfig(kind="webdataset", shards=tuple(paths)), tmp_path, build=True)
    assert ds.classes == ["ant", "bird", "cow"]
    assert ours(ds) == reference(paths)


def test_index_is_built_once_mapped_by_workers_and_rebuilt_when_a_shard_changes(tmp_path):
    paths = write_shards(tmp_path / "shards")
    cfg = WebDatasetConfig(kind="webdataset", shards=tuple(paths))
    cache = tmp_path / "cache"
    with pytest.raises(FileNotFoundError, match="no index"):
        open_dataset("wds", cfg, cache, build=False)
    first = open_dataset("wds", cfg, cache, build=True)
    (index_file,) = cache.glob("webdataset-*.bidx")
    stamp = index_file.stat().st_mtime_ns
    again = open_dataset("wds", cfg, cache, build=True)
    worker = open_dataset("wds", cfg, cache, build=False)
    assert index_file.stat().st_mtime_ns == stamp  # reused, not rebuilt
    assert ours(worker) == ours(again) == ours(first)
    # drop the last shard's last sample: the index is rebuilt, the old one removed
    with tarfile.open(paths[-1]) as tar:
        members = [(m, tar.extractfile(m).read()) for m in tar.getmembers()]
    with tarfile.open(paths[-1], "w") as tar:
        for m, data in members:
            if not m.name.startswith(f"{N_SHARDS * PER_SHARD - 1:06d}."):
                tar.addfile(m, io.BytesIO(data))
    changed = open_dataset("wds", cfg, cache, build=True)
    assert len(changed) == len(first) - 1 and changed.fingerprint != first.fingerprint
    assert len(list(cache.glob("webdataset-*.bidx"))) == 1


def test_errors_name_the_shard_and_sample(tmp_path):
    paths = write_shards(tmp_path / "shards")
    with pytest.raises(FileNotFoundError, match="shard .*train-000009.tar not found"):
        open_dataset("wds", WebDatasetConfig(kind="webdataset", shards=(*paths, str(tmp_path / "shards" / "train-000009.tar"))),
                     tmp_path, build=True)
    bad = tmp_path / "bad.tar"
    with tarfile.open(bad, "w") as tar:
        for name, data in (("a.png", _png(1)), ("a.cls", b"1"), ("b.png", _png(2)), ("b.txt", b"no label")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    with pytest.raises(ValueError, match=r"bad.tar: sample 'b' has no .cls or .json label"):
        open_dataset("wds", WebDatasetConfig(kind="webdataset", shards=str(bad)), tmp_path, build=True)
    # a shard truncated after indexing: a SampleError naming shard#key, not wrong bytes
    cfg = WebDatasetConfig(kind="webdataset", shards=paths[0])
    ds = open_dataset("wds", cfg, tmp_path / "c", build=True)
    os.truncate(paths[0], int(ds._offset[3]) + 10)
    with pytest.raises(SampleError, match="short read") as e:
        ds.read_bytes(3)
    assert e.value.dataset == "wds" and e.value.index == 3 and e.value.path == f"{paths[0]}#000003"


def test_a_server_serves_shards_from_disk_and_from_a_bucket_alike(seaweed, tmp_path, make_server):  # noqa: F811
    paths = write_shards(tmp_path / "shards")
    for p in paths:
        seaweed.upload_file(p, f"shards/{os.path.basename(p)}")
    url = f"s3://{seaweed.bucket}/shards/train-{{000000..000002}}.tar"
    server = make_server(datasets={
        "disk": {"kind": "webdataset", "shards": str(tmp_path / "shards" / "train-{000000..000002}.tar")},
        "s3": {"kind": "webdataset", "shards": url, "storage_options": seaweed.storage_options},
    })
    n = N_SHARDS * PER_SHARD
    want = {}
    for i, (key, data, label) in enumerate(reference(paths)):
        rgb = cv2.cvtColor(cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR), cv2.COLOR_BGR2RGB)
        want[i] = (rgb, label)
    for world_size in (1, 2):
        seen = []
        for rank in range(world_size):
            kw = dict(batch_size=4, shuffle=True, seed=11, rank=rank, world_size=world_size)
            with batchd.RemoteDataLoader(server.address, "disk", timeout=60, **kw) as a, \
                    batchd.RemoteDataLoader(server.address, "s3", timeout=60, **kw) as b:
                got_a, got_b = list(a), list(b)
            assert [digest(x) for x in got_a] == [digest(x) for x in got_b]
            for batch in got_b:
                for image, label, index in zip(batch["image"].numpy(), batch["label"].tolist(), batch["index"].tolist()):
                    assert np.array_equal(image, want[index][0]) and label == want[index][1]
                    seen.append(index)
        # every sample once over the ranks (plus DistributedSampler's padding to equal shards)
        assert sorted(set(seen)) == list(range(n)) and len(seen) == -(-n // world_size) * world_size
        assert shard_indices(n, shuffle=True, seed=11, epoch=0, rank=0, world_size=world_size,
                             drop_last=False).tolist() == seen[:len(seen) // world_size]


def test_batchd_shards_writes_what_the_image_folder_serves(tmp_path, capsys):
    from batchd.cli import main
    from batchd.server.config import ImageFolderConfig
    from helpers import write_png

    root = tmp_path / "photos"
    for n in range(11):
        write_png(root / ["cat", "dog"][n % 2] / f"{n:02d}.png", np.full((4, 5, 3), n, np.uint8))
    assert main(["shards", str(root), str(tmp_path / "out" / "train-%06d.tar"), "--samples-per-shard", "4"]) == 0
    pattern = str(tmp_path / "out" / "train-{000000..000002}.tar")
    assert f'shards: "{pattern}"' in capsys.readouterr().out
    folder = open_dataset("f", ImageFolderConfig(kind="imagefolder", root=root), tmp_path / "c1", build=True)
    shards = open_dataset("s", WebDatasetConfig(kind="webdataset", shards=pattern), tmp_path / "c2", build=True)
    assert len(shards) == len(folder) == 11
    for i in range(len(folder)):
        assert bytes(shards.read_bytes(i)) == folder.path(i).read_bytes()
        assert shards.label(i) == folder.label(i)
    # the webdataset package reads them too
    assert [label for _, _, label in reference(sorted(map(str, (tmp_path / "out").glob("*.tar"))))] == \
        [folder.label(i) for i in range(len(folder))]
