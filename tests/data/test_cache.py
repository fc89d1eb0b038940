"""The decoded-sample cache (server/data/cache/): component tests, then through a real server."""

from __future__ import annotations

import collections
import multiprocessing
import os
import secrets

import numpy as np
import pytest

from batchd.server.data.cache import SharedCache, sample_key
from batchd.server.shm import SHM_DIR

SHAPE = (64, 64, 3)  # 12 KiB per raw entry


def _image(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, SHAPE, np.uint8)


def _key(i: int, build: str = "b1") -> bytes:
    return sample_key("f" * 32, i, '{"transforms":[]}', build)


@pytest.fixture
def make_cache():
    made = []

    def make(memory_bytes=1 << 20, **kw):
        kw.setdefault("datasets", ["photos"])
        kw.setdefault("workers", 2)
        kw.setdefault("build", "b1")
        c = SharedCache.create(f"batchd-test-{secrets.token_hex(4)}-cache", memory_bytes=memory_bytes, **kw)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


class _Compute:
    def __init__(self):
        self.calls = 0

    def __call__(self, i):
        def compute():
            self.calls += 1
            return _image(i)
        return compute


def test_a_hit_serves_the_same_bytes_and_is_counted(make_cache):
    cache, compute = make_cache(), _Compute()
    first = [cache.get_or_compute("photos", _key(i), compute(i)) for i in range(10)]
    assert compute.calls == 10
    again = [cache.get_or_compute("photos", _key(i), compute(i)) for i in range(10)]
    assert compute.calls == 10
    for a, b, i in zip(first, again, range(10)):
        assert np.array_equal(a, b) and np.array_equal(b, _image(i)) and b.flags.writeable
    s = cache.stats()["photos"]
    assert (s["hits"], s["hits_ram"], s["misses"]) == (10, 10, 10)
    assert s["bytes_ram"] >= 10 * np.prod(SHAPE)
    assert cache.get_or_compute("other", _key(0), compute(0)) is not None and compute.calls == 11  # unknown: computed
    assert cache.get_or_compute("photos", None, compute(0)) is not None and compute.calls == 12


def test_memory_is_bounded_and_spills_to_disk_within_its_bound(make_cache, tmp_path):
    memory = 256 * 1024
    cache, compute = make_cache(memory, disk_dir=tmp_path, disk_bytes=200 * 1024), _Compute()
    for i in range(60):
        cache.get_or_compute("photos", _key(i), compute(i))
    assert os.path.getsize(SHM_DIR / cache._seg.name) == memory
    ram, on_disk = cache.bytes_used()
    s = cache.stats()["photos"]
    assert 0 < ram <= memory and s["bytes_ram"] == ram
    assert 0 < on_disk <= 200 * 1024 and s["bytes_disk"] == on_disk
    assert sum(f.stat().st_size for f in tmp_path.glob("entries/*/*/*")) == on_disk
    assert s["not_admitted"] > 0 and s["misses"] == 60
    left_out = s["not_admitted"]
    for i in range(60):  # what was kept is served, from RAM or disk; the rest recomputed
        assert np.array_equal(cache.get_or_compute("photos", _key(i), compute(i)), _image(i))
    s = cache.stats()["photos"]
    assert s["hits_ram"] > 0 and s["hits_disk"] > 0
    assert s["hits"] == 60 - left_out and s["not_admitted"] == 2 * left_out  # a fixed subset: nothing evicted


def test_a_corrupt_disk_entry_is_recomputed_never_served(make_cache, tmp_path):
    cache, compute = make_cache(64 * 1024, disk_dir=tmp_path, disk_bytes=1 << 20), _Compute()
    for i in range(8):
        cache.get_or_compute("photos", _key(i), compute(i))
    files = sorted(tmp_path.glob("entries/*/*/*"))
    assert files
    victim = files[0]
    data = bytearray(victim.read_bytes())
    data[-100] ^= 0xFF
    victim.write_bytes(bytes(data))
    files[1].write_bytes(files[1].read_bytes()[:30])  # truncated
    calls = compute.calls
    for i in range(8):
        assert np.array_equal(cache.get_or_compute("photos", _key(i), compute(i)), _image(i))
    assert compute.calls == calls + 2
    assert cache.stats()["photos"]["evictions"] == 2, cache.stats()


def test_a_corrupt_ram_entry_is_recomputed_never_served(make_cache):
    cache, compute = make_cache(), _Compute()
    cache.get_or_compute("photos", _key(0), compute(0))
    arena = cache._arena
    arena[200] = arena[200] ^ 0xFF
    assert np.array_equal(cache.get_or_compute("photos", _key(0), compute(0)), _image(0))
    assert compute.calls == 2 and cache.stats()["photos"]["evictions"] == 1


def test_disk_entries_survive_a_restart_only_with_the_same_build(make_cache, tmp_path):
    first, compute = make_cache(64 * 1024, disk_dir=tmp_path, disk_bytes=1 << 20), _Compute()
    for i in range(10):
        first.get_or_compute("photos", _key(i), compute(i))
    on_disk = first.bytes_used()[1]
    first.close()
    again = make_cache(64 * 1024, disk_dir=tmp_path, disk_bytes=1 << 20)  # a restart, same build
    assert again.bytes_used()[1] == on_disk and again.stats()["photos"]["bytes_disk"] == on_disk
    calls = compute.calls
    for i in range(10):
        assert np.array_equal(again.get_or_compute("photos", _key(i), compute(i)), _image(i))
    assert compute.calls - calls < 10 and again.stats()["photos"]["hits_disk"] > 0
    again.close()
    other = make_cache(64 * 1024, disk_dir=tmp_path, disk_bytes=1 << 20, build="b2")
    assert other.bytes_used()[1] == 0 and not list(tmp_path.glob("entries/*/*/*"))


def test_disk_entries_unused_for_max_idle_are_removed_at_start(make_cache, tmp_path):
    first, compute = make_cache(64 * 1024, disk_dir=tmp_path, disk_bytes=1 << 20), _Compute()
    for i in range(10):
        first.get_or_compute("photos", _key(i), compute(i))
    files = sorted(tmp_path.glob("entries/*/*/*"))
    assert len(files) >= 4
    long_ago = os.path.getmtime(files[0]) - 3600
    for f in files:
        os.utime(f, (long_ago, long_ago))
    for i in range(10):
        first.get_or_compute("photos", _key(i), compute(i))
    assert first.stats()["photos"]["hits_disk"] == len(files)  # each hit refreshed its file's mtime
    for f in files[:2]:  # two entries left unused for an hour
        os.utime(f, (long_ago, long_ago))
    first.close()
    again = make_cache(64 * 1024, disk_dir=tmp_path, disk_bytes=1 << 20, disk_max_idle_s=1800)
    assert sorted(tmp_path.glob("entries/*/*/*")) == files[2:]
    assert again.bytes_used()[1] == sum(f.stat().st_size for f in files[2:])


def test_a_disk_dir_in_use_by_another_server_is_not_shared(make_cache, tmp_path):
    a = make_cache(64 * 1024, disk_dir=tmp_path, disk_bytes=1 << 20)
    b = make_cache(64 * 1024, disk_dir=tmp_path, disk_bytes=1 << 20)
    assert a.disk_root is not None and b.disk_root is None


def _child(name: str, worker_id: int, n: int) -> None:
    cache = SharedCache.attach(name, worker_id)
    for i in range(n):
        cache.get_or_compute("photos", _key(i), lambda i=i: _image(i))
    cache.close()


def test_processes_share_entries_and_counters(make_cache):
    cache = make_cache()
    ctx = multiprocessing.get_context("forkserver")
    p = ctx.Process(target=_child, args=(cache._seg.name, 1, 12))
    p.start()
    p.join(60)
    assert p.exitcode == 0
    for i in range(12):
        assert np.array_equal(cache.get_or_compute("photos", _key(i), lambda: pytest.fail("recomputed")), _image(i))
    s = cache.stats()["photos"]
    assert (s["misses"], s["hits"]) == (12, 12)


def test_a_failing_cache_falls_back_to_computing(make_cache, tmp_path):
    cache, compute = make_cache(64 * 1024, disk_dir=tmp_path, disk_bytes=1 << 20), _Compute()
    (tmp_path / "entries").chmod(0o500)  # disk writes fail
    try:
        for i in range(10):
            assert np.array_equal(cache.get_or_compute("photos", _key(i), compute(i)), _image(i))
    finally:
        (tmp_path / "entries").chmod(0o700)
    if os.geteuid() != 0:
        assert cache.stats()["photos"]["errors"] > 0
    assert cache.bytes_used()[1] == sum(f.stat().st_size for f in tmp_path.glob("entries/*/*/*"))
    with pytest.raises(ZeroDivisionError):  # what compute raises still propagates
        cache.get_or_compute("photos", _key(99), lambda: 1 / 0)


def test_compression_is_lossless_and_kept_only_where_it_pays(make_cache):
    cache = make_cache(compress=True)
    smooth = np.tile(np.arange(64, dtype=np.uint8)[:, None, None], (1, 64, 3))
    cache.get_or_compute("photos", _key(0), lambda: smooth)
    cache.get_or_compute("photos", _key(1), lambda: _image(1))  # noise: stored raw
    assert np.array_equal(cache.get_or_compute("photos", _key(0), pytest.fail), smooth)
    assert np.array_equal(cache.get_or_compute("photos", _key(1), pytest.fail), _image(1))
    assert cache.stats()["photos"]["bytes_ram"] < 48 + smooth.nbytes // 2 + 48 + _image(1).nbytes


def test_fixed_subset_beats_lru_on_cyclic_scans(make_cache):
    """Hit rates over 3 epochs of 40 samples with room for ~10: sequential and shuffled orders."""
    entry = 48 + int(np.prod(SHAPE))
    room = 10
    rng = np.random.default_rng(0)
    orders = {"sequential": [list(range(40))] * 3, "shuffled": [list(rng.permutation(40)) for _ in range(3)]}
    for name, epochs in orders.items():
        lru: collections.OrderedDict[int, None] = collections.OrderedDict()
        lru_hits = 0
        for epoch in epochs:
            for i in epoch:
                if i in lru:
                    lru_hits += 1
                    lru.move_to_end(i)
                else:
                    lru[i] = None
                    if len(lru) > room:
                        lru.popitem(last=False)
        cache = make_cache(_arena_for(room * entry))
        for epoch in epochs:
            for i in epoch:
                cache.get_or_compute("photos", _key(int(i)), lambda i=i: _image(int(i)))
        fixed_hits = cache.stats()["photos"]["hits"]
        print(f"{name}: LRU {lru_hits} hits, fixed subset {fixed_hits} hits of {3 * 40}")
        assert fixed_hits >= 2 * room - 2  # epochs 2 and 3 each hit what was kept
        if name == "sequential":
            assert lru_hits == 0
        assert fixed_hits > lru_hits


def _arena_for(nbytes: int) -> int:
    """memory_bytes giving an arena of about nbytes (header, counters, table: 64 KiB here)."""
    return 64 * 1024 + nbytes + 4096


# -- through a real server ------------------------------------------------------------------------------------

import albumentations as A  # noqa: E402
import cv2  # noqa: E402

import batchd  # noqa: E402
from helpers import digest  # noqa: E402

PIPELINE = A.Compose([A.Resize(64, 64), A.HorizontalFlip(), A.RandomCrop(48, 48), A.RandomBrightnessContrast(p=1)])
IMAGES = 24


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    """24 JPEGs (300 x 400, smooth noise) in two class folders."""
    root = tmp_path_factory.mktemp("photos")
    rng = np.random.default_rng(1)
    for i in range(IMAGES):
        image = cv2.GaussianBlur(rng.integers(0, 256, (300, 400, 3), np.uint8), (0, 0), 2)
        (root / f"c{i % 2}").mkdir(exist_ok=True)
        cv2.imwrite(str(root / f"c{i % 2}" / f"{i:03d}.jpg"), image)
    return root


def _epochs(server, epochs: int = 2) -> list[str]:
    """Digests of every batch of ``epochs`` shuffled epochs (batch 8) of PIPELINE."""
    out = []
    with batchd.RemoteDataLoader(server.address, "photos", batch_size=8, shuffle=True, seed=5,
                                 transform=PIPELINE, timeout=60) as loader:
        for _ in range(epochs):
            out.extend(digest(b) for b in loader)
    return out


def _serve(make_server, photos, workers, **cache):
    return make_server(datasets={"photos": {"kind": "imagefolder", "root": str(photos)}}, workers=workers,
                       **({"cache": cache} if cache else {}))


@pytest.fixture(scope="module")
def uncached(photos, tmp_path_factory):
    from conftest import running_server

    with running_server(datasets={"photos": {"kind": "imagefolder", "root": str(photos)}}, workers=1,
                        cache_dir=tmp_path_factory.mktemp("idx")) as server:
        assert server.loader.cache is None
        return _epochs(server)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [1, 2])
def test_a_server_sends_the_same_bytes_with_the_cache(make_server, photos, uncached, workers):
    server = _serve(make_server, photos, workers, memory_bytes="8MiB")
    assert _epochs(server) == uncached
    s = server.loader.cache.stats()["photos"]
    assert s["misses"] == IMAGES and s["hits"] == IMAGES  # epoch 2 is all hits
    assert s["bytes_ram"] >= IMAGES * 64 * 64 * 3


@pytest.mark.timeout(180)
def test_a_warm_disk_cache_survives_a_restart_and_a_corrupt_entry_is_recomputed(make_server, photos, uncached,
                                                                                 tmp_path):
    small = {"memory_bytes": "128KiB", "disk_dir": tmp_path, "disk_bytes": "16MiB"}  # ~6 entries fit in RAM
    first = _serve(make_server, photos, 2, **small)
    assert _epochs(first) == uncached
    s = first.loader.cache.stats()["photos"]
    assert s["hits_disk"] > 0 and s["bytes_disk"] > 0
    assert os.path.getsize(SHM_DIR / f"{first.loader.owner.prefix}cache") == 128 * 1024  # RAM: exactly memory_bytes
    assert s["bytes_ram"] <= 128 * 1024
    first.stop(grace=1.0)
    files = sorted(tmp_path.glob("entries/*/*/*"))
    assert len(files) >= IMAGES // 2
    data = bytearray(files[0].read_bytes())
    data[-10] ^= 0x55
    files[0].write_bytes(bytes(data))
    again = _serve(make_server, photos, 2, **small)
    assert _epochs(again) == uncached
    s = again.loader.cache.stats()["photos"]
    assert s["hits_disk"] >= len(files) - 1 and s["evictions"] == 1


@pytest.mark.timeout(120)
def test_cache_figures_in_stats_metrics_and_batchd_status(make_server, photos):
    import subprocess
    import sys

    from batchd.client.transport.server_stats import get_stats, stats_dict

    server = _serve(make_server, photos, 1, memory_bytes="8MiB")
    _epochs(server)
    reply = get_stats(server.address)
    (c,) = reply.cache
    assert (c.dataset, c.hits, c.misses, c.hits_disk) == ("photos", IMAGES, IMAGES, 0) and c.bytes_ram > 0
    assert stats_dict(reply)["cache"][0]["hits"] == IMAGES
    out = subprocess.run([sys.executable, "-m", "batchd.cli", "status", server.address], capture_output=True,
                         text=True, timeout=60).stdout
    assert f"cache:    photos: {IMAGES} hits (0 from disk), {IMAGES} misses" in out, out


@pytest.mark.timeout(120)
def test_cache_metrics_per_dataset(make_server, photos):
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    server = make_server(datasets={"photos": {"kind": "imagefolder", "root": str(photos)}}, workers=1,
                         metrics_port=0, cache={"memory_bytes": "8MiB"})
    _epochs(server, epochs=1)
    text = urllib.request.urlopen(f"http://{server.metrics_address}/metrics", timeout=10).read().decode()
    got = {(s.name, tuple(sorted(s.labels.items()))): s.value
           for f in text_string_to_metric_families(text) for s in f.samples}
    assert got[("batchd_cache_misses_total", (("dataset", "photos"),))] == IMAGES
    assert got[("batchd_cache_hits_total", (("dataset", "photos"), ("tier", "ram")))] == 0
    assert got[("batchd_cache_bytes", (("dataset", "photos"), ("tier", "ram")))] > 0


@pytest.mark.timeout(120)
def test_a_token_sees_the_cache_figures_of_its_datasets_only(make_server, photos):
    from batchd.client.transport.server_stats import get_stats

    tokens = [{"name": "team-a", "token": "a" * 32, "datasets": ["photos"]},
              {"name": "admin", "token": "b" * 32, "datasets": ["*"]}]
    server = make_server(datasets={"photos": {"kind": "imagefolder", "root": str(photos)},
                                   "secret": {"kind": "imagefolder", "root": str(photos)}},
                         workers=1, auth={"tokens": tokens}, cache={"memory_bytes": "1MiB"})
    assert [c.dataset for c in get_stats(server.address, token="b" * 32).cache] == ["photos", "secret"]
    assert [c.dataset for c in get_stats(server.address, token="a" * 32).cache] == ["photos"]


def test_the_cache_config_reads_sizes_and_refuses_what_cannot_work(tmp_path):
    from batchd.server.config import ConfigError, ServerConfig, load_config

    c = ServerConfig.model_validate({"cache": {"memory_bytes": "8GiB", "disk_dir": str(tmp_path), "disk_bytes": "200GB"}})
    assert (int(c.cache.memory_bytes), int(c.cache.disk_bytes)) == (8 << 30, 200 * 10**9)
    assert int(ServerConfig().cache.memory_bytes) == 0  # no cache by default
    for bad, words in [({"memory_bytes": "8 bananas"}, "cache.memory_bytes"),
                       ({"memory_bytes": 1000}, "at least 64 KiB"),
                       ({"memory_bytes": "1GiB", "disk_bytes": "1GiB"}, "disk_bytes needs a disk_dir"),
                       ({"disk_dir": str(tmp_path), "disk_bytes": "1GiB"}, "needs memory_bytes"),
                       ({"memory_bytes": "1GiB", "size": 1}, "cache.size")]:
        path = tmp_path / "c.yaml"
        path.write_text(__import__("yaml").safe_dump({"cache": bad}))
        with pytest.raises(ConfigError, match=words.replace(".", r"\.")):
            load_config(path)


def test_a_worker_does_not_read_ahead_the_bytes_of_cached_samples(photos, tmp_path):
    """The reader's per-sample function returns None for a cached sample, the bytes otherwise."""
    import types

    from batchd.server.compute import pipeline as pipelines
    from batchd.server.config import ImageFolderConfig
    from batchd.server.data.datasets import open_dataset
    from batchd.server.compute.worker import _Worker

    cfg = ImageFolderConfig(kind="imagefolder", root=photos)
    open_dataset("photos", cfg, tmp_path, build=True)  # the server builds the index first
    prefix = f"batchd-test-{secrets.token_hex(4)}-"
    cache = SharedCache.create(f"{prefix}cache", memory_bytes=1 << 20, datasets=["photos"], workers=1, build="b")
    try:
        worker = _Worker(0, {"photos": cfg}, tmp_path, prefix)
        assert worker.cache is not None
        text = pipelines.canonical_json(A.to_dict(PIPELINE))
        task = types.SimpleNamespace(pipeline_key=pipelines.pipeline_key(text), pipeline_json=text, encoding="decoded")
        ds = worker.dataset("photos")
        read = worker._reads(task, ds)
        plan = worker.pipelines[task.pipeline_key]
        key = sample_key(ds.fingerprint, 3, plan.split.canonical, worker.builds["photos"])
        assert read(3) is not None
        cache.get_or_compute("photos", key,
                             lambda: plan.targets.begin(ds.load_sample(3, plan.split.min_size), lambda f: False))
        assert read(3) is None and bytes(read(4)) == bytes(ds.read_bytes(4))
        worker.cache.close()
    finally:
        cache.close()
