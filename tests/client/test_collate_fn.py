"""``RemoteDataLoader(..., collate_fn=...)`` against torch's own ``DataLoader`` as the oracle: the same
samples as a map-style torch ``Dataset``, the same ``collate_fn``, the same structure and values;
and the default dict batch against ``torch.utils.data.default_collate`` where shapes agree.

The samples are served by a real gRPC server through batchd's real Transport (tests/batch_server.py).
"""

from __future__ import annotations

import gc
import threading
import time

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, default_collate

import batchd
import batches
from batch_server import BatchServer
from helpers import wait_until

pytestmark = pytest.mark.timeout(60)

N, B = 10, 4
SLOW_S = 0.5  # seconds per batch of test_collate_fn_with_several_servers' slow server


class Samples(Dataset):
    """The server's samples as a torch ``Dataset`` returns them: a dict of tensors (0-d for numbers,
    int64 ``index`` and ``position``), str and bytes as they are."""

    def __init__(self, n: int, **kw):
        self.n, self.kw = n, kw

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        return batches.torch_sample(i, **self.kw)


class ImageTarget(Samples):
    """The same samples as torchvision's detection datasets return them: (image, target dict)."""

    def __getitem__(self, i: int) -> tuple:
        sample = super().__getitem__(i)
        return sample.pop("image"), sample


def assert_same(got, want, where: str = "batch") -> None:
    """Same structure (types, lengths, keys in order) and values (tensors: dtype, shape, bytes)."""
    assert type(got) is type(want), f"{where}: {type(got).__name__} vs {type(want).__name__}"
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got.cpu(), want), where
    elif isinstance(want, dict):
        assert list(got) == list(want), where
        for k in want:
            assert_same(got[k], want[k], f"{where}[{k!r}]")
    elif isinstance(want, list | tuple):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{where}[{i}]")
    else:
        assert got == want, where


def pad_images(samples: list[dict]) -> dict:
    """A user's collate_fn: images zero-padded to the largest and stacked, targets as lists."""
    h = max(s["image"].shape[0] for s in samples)
    w = max(s["image"].shape[1] for s in samples)
    images = torch.zeros((len(samples), h, w, 3), dtype=torch.uint8)
    for i, s in enumerate(samples):
        images[i, :s["image"].shape[0], :s["image"].shape[1]] = s["image"]
    return {"image": images, "boxes": [s["boxes"] for s in samples],
            "label": torch.stack([s["label"] for s in samples])}


COLLATE = {
    "identity": lambda x: x,
    "zip": lambda x: tuple(zip(*x)),  # over dict samples: the keys, as DataLoader gives them
    "pad": pad_images,
}


@pytest.fixture(scope="module")
def server():
    with BatchServer(batches.detection_samples, N) as s:
        yield s


@pytest.mark.parametrize("transport", ["inline", "shm"])
@pytest.mark.parametrize("name", list(COLLATE))
def test_collate_fn_gets_what_dataloader_gives_its_collate_fn(server, transport, name):
    fn = COLLATE[name]
    want = list(DataLoader(Samples(N), batch_size=B, collate_fn=fn))
    with batchd.RemoteDataLoader(server.address, "handmade", batch_size=B, transport=transport,
                                 collate_fn=fn) as loader:
        got = list(loader)
    assert_same(got, want)


def test_detection_collate_gives_torchvisions_images_and_targets(server):
    """torchvision's detection references: a Dataset of (image, target) and collate_fn=lambda x:
    tuple(zip(*x)) give (images, targets); batchd.detection_collate over batchd's dict samples gives
    the same (the README's earlier one-liner, which pops the image out of each sample, too)."""
    want = list(DataLoader(ImageTarget(N), batch_size=B, collate_fn=lambda x: tuple(zip(*x))))
    for fn in (batchd.detection_collate, lambda x: tuple(zip(*[(s.pop("image"), s) for s in x]))):
        with batchd.RemoteDataLoader(server.address, "handmade", batch_size=B, collate_fn=fn) as loader:
            got = list(loader)
        assert_same(got, want)
    images, targets = got[0]
    assert len(images) == len(targets) == B and tuple(targets[3]["boxes"].shape) == (3, 4)


def test_detection_collate_leaves_the_samples_alone_and_always_gives_a_pair():
    samples = [Samples(N)[i] for i in range(3)]
    fields = [list(s) for s in samples]
    images, targets = batchd.detection_collate(samples)
    assert [list(s) for s in samples] == fields, "detection_collate modified the samples"
    assert images[1] is samples[1]["image"] and targets[1]["boxes"] is samples[1]["boxes"]
    assert batchd.detection_collate([]) == ((), ())  # every sample skipped: still (images, targets)
    assert tuple(zip(*[])) == ()  # where the one-liner gives nothing to unpack
    with pytest.raises(ValueError, match=r"sample 1 of the batch \(dataset index 1\) has no 'image' field; "
                                         r"its fields: \['blob', 'boxes'"):
        batchd.detection_collate([samples[0], {k: v for k, v in samples[1].items() if k != "image"}])


@pytest.mark.parametrize("transport", ["inline", "shm"])
def test_the_default_batch_is_default_collate_where_shapes_agree(transport):
    """Images of one size, one object each: every field stacks, and the dict batch (collate_fn=None)
    is exactly DataLoader's default_collate of the same samples (str and bytes fields as lists);
    collate_fn=default_collate gives the same again."""
    kw = dict(fixed_size=True, objects=1)
    want = list(DataLoader(Samples(N, **kw), batch_size=B))
    with BatchServer(lambda idx: batches.detection_samples(idx, **kw), N) as s:
        with batchd.RemoteDataLoader(s.address, "handmade", batch_size=B, transport=transport) as loader:
            assert_same(list(loader), want)
        with batchd.RemoteDataLoader(s.address, "handmade", batch_size=B, transport=transport,
                                     collate_fn=default_collate) as loader:
            assert_same(list(loader), want)


def test_where_shapes_differ_default_collate_refuses_and_the_batch_has_lists(server):
    samples = [Samples(N)[i] for i in range(B)]
    with pytest.raises(RuntimeError, match="stack expects each tensor to be equal size"):
        default_collate(samples)
    with batchd.RemoteDataLoader(server.address, "handmade", batch_size=B) as loader:
        batch = next(iter(loader))
    for name in ("image", "boxes", "labels", "masks"):
        assert_same(batch[name], [s[name] for s in samples], name)
    for name in ("label", "index", "position", "name", "blob"):
        assert_same(batch[name], default_collate([s[name] for s in samples]), name)


def _slow_samples(idx):
    time.sleep(SLOW_S)
    return batches.detection_samples(idx)


def test_collate_fn_with_several_servers():
    """Batches from two servers go through one collate_fn. One server takes SLOW_S per batch, so
    the other, up well before the pass could end without it (under load too: the pass begins with
    the servers that are up), sends some."""
    with BatchServer(_slow_samples, N) as slow, BatchServer(batches.detection_samples, N) as other:
        with batchd.RemoteDataLoader([slow.address, other.address], "handmade", batch_size=B,
                                     collate_fn=COLLATE["pad"]) as loader:
            got = list(loader)
        assert other.layouts, "the second server sent nothing"
    assert_same(got, list(DataLoader(Samples(N), batch_size=B, collate_fn=COLLATE["pad"])))


def test_skipped_samples_are_not_passed_to_collate_fn():
    with BatchServer(batches.detection_samples, N, skip={1, 9}) as s:
        with batchd.RemoteDataLoader(s.address, "handmade", batch_size=B, collate_fn=lambda x: x) as loader:
            got = list(loader)
    assert [[int(x["index"]) for x in b] for b in got] == [[0, 2, 3], [4, 5, 6, 7], [8]]
    assert all("skipped" not in x for b in got for x in b)


def test_collate_fn_runs_in_the_converter_thread_and_its_errors_reach_the_loop(server):
    threads = []

    def fn(samples):
        threads.append(threading.current_thread().name)
        if int(samples[0]["index"]) == 4:
            raise KeyError("no such field, says the user's collate_fn")
        return samples

    with batchd.RemoteDataLoader(server.address, "handmade", batch_size=B, collate_fn=fn) as loader:
        it = iter(loader)
        next(it)
        with pytest.raises(KeyError, match="says the user's collate_fn"):
            next(it)
    assert threads and set(threads) == {"batchd-loader"}  # (one thread converts, in batch order)


def test_samples_kept_by_collate_fn_keep_the_slot_lent(server):
    with batchd.RemoteDataLoader(server.address, "handmade", batch_size=B, transport="shm",
                                 collate_fn=lambda x: [s["masks"] for s in x]) as loader:
        masks = next(iter(loader))
        session = loader._shm.session
        # the pass was let go of: the batches sent behind the first go back (asynchronously, on the
        # call, which the loader keeps for its next pass): only the first stays lent
        assert wait_until(lambda: server.leases.held(session) == 1), server.leases.held(session)
        kept = masks[3]
        del masks
        gc.collect()
        assert not wait_until(lambda: server.leases.held(session) == 0, timeout=1.0), \
            "the slot went back while a sample's mask still lies on it"
        del kept
        gc.collect()
        assert wait_until(lambda: server.leases.held(session) == 0), "the lease did not come back"


def test_collate_fn_must_be_callable(server):
    with pytest.raises(ValueError, match="collate_fn must be None or a callable"):
        batchd.RemoteDataLoader(server.address, "handmade", collate_fn="default")


@pytest.mark.parametrize("transport", ["inline", "shm"])
def test_loader_stats_count_samples_whatever_collate_fn_returns(server, transport):
    """stats() counts the samples each batch held, not what collate_fn made of it (a tuple here)."""
    with batchd.RemoteDataLoader(server.address, "handmade", batch_size=B, transport=transport,
                                 collate_fn=lambda x: tuple(zip(*[(s.pop("image"), s) for s in x]))) as loader:
        got = list(loader)
        stats = loader.stats()
    assert stats["batches"] == len(got) and stats["samples"] == N == sum(len(images) for images, _ in got)
