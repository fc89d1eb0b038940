"""GpuTransform on CPU tensors: against a NumPy reference, its randomness, determinism, errors.

The reference below is written from the documented definition (client/device/finish.py's docstring),
independently of the module: Philox4x32-10 in Python integers (checked against Random123's
known-answer vectors), the crop/flip by NumPy slicing, the arithmetic in NumPy float32 and
bfloat16 rounding by hand. Outputs must be equal bit for bit, not close.

Chi-square tests are computed by hand and compared with the critical value at alpha = 0.001; the
seed is fixed, so every test is deterministic.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from batchd import GpuTransform
from batchd.client.device.finish import finish_key, philox4x32

IMAGENET = dict(mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225))

# Upper 0.001 critical values of chi-square by degrees of freedom (NIST/SEMATECH e-Handbook,
# section 1.3.6.7.4), as in tests/compute/test_randomness.py.
CHI2_CRITICAL_001 = {1: 10.828, 8: 26.124, 64: 104.716}

# Random123's kat_vectors: counter (4 words), key (2 words) -> output (4 words), philox4x32 10 rounds.
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


# --- the reference -------------------------------------------------------------------------------

def philox_reference(counter, key):
    """Philox4x32-10 on Python ints (Salmon et al. 2011, as Random123 defines it)."""
    c, (k0, k1) = list(counter), key
    for r in range(10):
        if r:
            k0, k1 = (k0 + 0x9E3779B9) % 2**32, (k1 + 0xBB67AE85) % 2**32
        p0, p1 = 0xD2511F53 * c[0], 0xCD9E8D57 * c[2]
        c = [(p1 >> 32) ^ c[1] ^ k0, p1 % 2**32, (p0 >> 32) ^ c[3] ^ k1, p0 % 2**32]
    return c


def reference_draws(position, seed, epoch, hflip, vflip, size, crop):
    """(hflip, vflip, top, left) of one sample, from the documented derivation."""
    key = tuple(int(k) for k in np.random.SeedSequence([seed, epoch], spawn_key=(2,)).generate_state(2, np.uint32))
    w = philox_reference((position % 2**32, position >> 32, 0, 0), key)
    (height, width), (h, w_) = size, crop
    return (w[0] < round(hflip * 2**32), w[1] < round(vflip * 2**32),
            (w[2] * (height - h + 1)) >> 32, (w[3] * (width - w_ + 1)) >> 32)


def bfloat16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), rounding to nearest even (no NaNs here)."""
    bits = x.view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def reference(images, positions, *, seed, epoch, mean=None, std=None, dtype=torch.float32, hflip=0.0, vflip=0.0,
              crop=None):
    """NumPy: float32 [B, C, h, w] (or uint16 bfloat16 bits, or float16) of uint8 images [B, H, W, C]."""
    b, height, width, c = images.shape
    crop = (crop, crop) if isinstance(crop, int) else crop or (height, width)
    out = []
    for image, position in zip(images, positions):
        hf, vf, top, left = reference_draws(int(position), seed, epoch, hflip, vflip, (height, width), crop)
        x = image[top:top + crop[0], left:left + crop[1]]
        x = x[:, ::-1] if hf else x
        x = x[::-1] if vf else x
        out.append(x.transpose(2, 0, 1))
    x = np.stack(out).astype(np.float32) / np.float32(255)
    x = x - np.asarray(mean if mean is not None else [0.0] * c, np.float32).reshape(1, -1, 1, 1)
    x = x / np.asarray(std if std is not None else [1.0] * c, np.float32).reshape(1, -1, 1, 1)
    if dtype == torch.bfloat16:
        return bfloat16_bits(np.ascontiguousarray(x))
    return x.astype(np.float16) if dtype == torch.float16 else x


def as_numpy(out: torch.Tensor) -> np.ndarray:
    if out.dtype == torch.bfloat16:
        return out.contiguous().view(torch.int16).numpy().view(np.uint16)
    return out.contiguous().numpy()


def random_images(b=12, h=23, w=31, c=3, seed=0) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).integers(0, 256, (b, h, w, c), dtype=np.uint8))


# --- exactness -------------------------------------------------------------------------------------

@pytest.mark.parametrize("counter,key,expected", KAT)
def test_philox_matches_the_known_answer_vectors(counter, key, expected):
    assert philox_reference(counter, key) == list(expected)
    out = philox4x32([torch.tensor([c]) for c in counter], key)
    assert [int(o) for o in out] == list(expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("augment", [
    dict(),
    dict(hflip=0.5),
    dict(vflip=0.5, crop=16),
    dict(hflip=0.5, vflip=0.5, crop=(11, 29)),
    dict(hflip=1.0, vflip=1.0, crop=(23, 31)),
])
def test_output_equals_the_numpy_reference_bit_for_bit(dtype, channels_last, augment):
    images = random_images()
    positions = torch.tensor([0, 5, 1, 2**32 + 3, 7, 1000, 3, 2**40, 9, 10, 11, 12])
    transform = GpuTransform(**IMAGENET, dtype=dtype, channels_last=channels_last, **augment)
    out = transform(images, positions, seed=2024, epoch=3)
    crop = augment.get("crop")
    crop = (crop, crop) if isinstance(crop, int) else crop
    assert out.dtype == dtype and out.shape == (12, 3, *(crop or (23, 31)))
    assert out.is_contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    expected = reference(images.numpy(), positions.tolist(), seed=2024, epoch=3, dtype=dtype, **IMAGENET, **augment)
    np.testing.assert_array_equal(as_numpy(out), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_equals_the_hand_written_normalisation_on_the_cpu(dtype):
    images = random_images(b=4, h=64, w=48)
    out = GpuTransform(**IMAGENET, dtype=dtype)(images, torch.arange(4), seed=0, epoch=0)
    mean, std = torch.tensor(IMAGENET["mean"]).view(1, 3, 1, 1), torch.tensor(IMAGENET["std"]).view(1, 3, 1, 1)
    assert torch.equal(out, images.permute(0, 3, 1, 2).float().div(255).sub(mean).div(std).to(dtype))


def test_one_channel_and_defaults_divide_by_255():
    images = random_images(c=1)
    out = GpuTransform()(images, torch.arange(12), seed=0, epoch=0)
    np.testing.assert_array_equal(out.numpy(), images.numpy().transpose(0, 3, 1, 2).astype(np.float32) / np.float32(255))
    one = GpuTransform(mean=0.5, std=0.25)(images, torch.arange(12), seed=0, epoch=0)
    np.testing.assert_array_equal(one.numpy(), reference(images.numpy(), range(12), seed=0, epoch=0, mean=[0.5], std=[0.25]))


@pytest.mark.parametrize("channels_last", [False, True])
def test_an_empty_batch_gives_an_empty_output(channels_last):
    for images in (random_images(b=0), torch.empty((0, 0, 0, 3), dtype=torch.uint8)):  # the latter: all skipped
        for crop, size in ((8, (8, 8)), ((5, 7), (5, 7)), (None, tuple(images.shape[1:3]))):
            transform = GpuTransform(crop=crop, hflip=0.5, dtype=torch.bfloat16, channels_last=channels_last)
            out = transform(images, torch.zeros(0, dtype=torch.int64), seed=0, epoch=0)
            assert out.shape == (0, 3, *size) and out.dtype == torch.bfloat16


# --- randomness ----------------------------------------------------------------------------------

def chi2(table: np.ndarray, expected: np.ndarray) -> float:
    return float(((table - expected) ** 2 / expected).sum())


def independence(table: np.ndarray) -> tuple[float, int]:
    expected = np.outer(table.sum(1), table.sum(0)) / table.sum()
    return chi2(table, expected), (table.shape[0] - 1) * (table.shape[1] - 1)


def test_flip_frequencies_follow_their_probabilities_and_are_independent():
    n = 20_000
    p = GpuTransform(hflip=0.3, vflip=0.6).params(torch.arange(n), seed=7, epoch=1, height=8, width=8)
    h, v = p.hflip.numpy(), p.vflip.numpy()
    for flags, prob, what in ((h, 0.3, "hflip"), (v, 0.6, "vflip")):
        observed = np.array([flags.sum(), n - flags.sum()])
        stat = chi2(observed, np.array([prob * n, (1 - prob) * n]))
        assert stat < CHI2_CRITICAL_001[1], f"{what}: {observed[0]} of {n} flipped, p={prob}: chi-square {stat:.1f}"
    table = np.zeros((2, 2), np.int64)
    np.add.at(table, (h.astype(int), v.astype(int)), 1)
    stat, df = independence(table)
    assert stat < CHI2_CRITICAL_001[df], f"hflip and vflip are not independent: chi-square {stat:.1f}\n{table}"
    never = GpuTransform(hflip=0.0, vflip=1.0).params(torch.arange(n), seed=7, epoch=1, height=8, width=8)
    assert not never.hflip.any() and never.vflip.all()


def test_crop_offsets_cover_their_range_uniformly_and_independently():
    n, side, crop = 20_000, 40, 32
    p = GpuTransform(crop=crop, hflip=0.5).params(torch.arange(n), seed=11, epoch=0, height=side, width=side)
    top, left = p.top.numpy(), p.left.numpy()
    assert top.min() == 0 and left.min() == 0 and top.max() == side - crop and left.max() == side - crop
    for offsets, what in ((top, "top"), (left, "left")):
        counts = np.bincount(offsets, minlength=side - crop + 1)
        stat = chi2(counts, np.full(counts.shape, n / counts.size))
        assert stat < CHI2_CRITICAL_001[counts.size - 1], f"{what} offsets not uniform: {counts}"
    table = np.zeros((side - crop + 1,) * 2, np.int64)
    np.add.at(table, (top, left), 1)
    stat, df = independence(table)
    assert stat < CHI2_CRITICAL_001[df], f"top and left are not independent: chi-square {stat:.1f}"
    stat, df = independence(np.stack([np.bincount(top[p.hflip.numpy() == f], minlength=9) for f in (0, 1)]))
    assert stat < CHI2_CRITICAL_001[df], "the crop's top depends on the horizontal flip"


def test_same_position_same_output_whatever_the_batch_composition_and_order():
    images = random_images(b=64, h=20, w=20, seed=3)
    positions = torch.arange(100, 164)
    transform = GpuTransform(**IMAGENET, hflip=0.5, vflip=0.5, crop=12)
    whole = transform(images, positions, seed=5, epoch=2)
    order = np.random.default_rng(0).permutation(64)
    start = 0
    for size in (1, 5, 17, 41):
        part = torch.from_numpy(order[start:start + size])
        start += size
        assert torch.equal(transform(images[part], positions[part], seed=5, epoch=2), whole[part])
    other_epoch = transform(images, positions, seed=5, epoch=3)
    other_seed = transform(images, positions, seed=6, epoch=2)
    for other in (other_epoch, other_seed):  # 1 in 4 * 81 samples alike by chance
        same = sum(torch.equal(a, b) for a, b in zip(whole, other))
        assert same < 8, f"{same} of 64 samples augmented alike under another seed or epoch"


def test_the_key_is_a_sibling_of_the_servers_augmentation_key():
    from batchd.sampler import sample_key

    assert finish_key(seed=3, epoch=4) == tuple(
        int(k) for k in np.random.SeedSequence([3, 4], spawn_key=(2,)).generate_state(2, np.uint32))
    server = sample_key(seed=3, epoch=4).view(np.uint32)[:2].tolist()
    assert list(finish_key(seed=3, epoch=4)) != server


# --- errors --------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,name", [
    (dict(mean=(0.5, 0.5), std=(0.2, 0.2, 0.2)), "mean and std"),
    (dict(std=(0.2, 0.0, 0.2)), "std"),
    (dict(mean="abc"), "mean"),
    (dict(mean=(float("nan"),)), "mean"),
    (dict(dtype=torch.int32), "dtype"),
    (dict(dtype="float64"), "dtype"),
    (dict(channels_last=1), "channels_last"),
    (dict(hflip=1.5), "hflip"),
    (dict(vflip=-0.1), "vflip"),
    (dict(hflip=True), "hflip"),
    (dict(crop=0), "crop"),
    (dict(crop=(8,)), "crop"),
    (dict(crop=(8, 8.0)), "crop"),
])
def test_bad_settings_raise_naming_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=rf"^{name}"):
        GpuTransform(**kwargs)


@pytest.mark.parametrize("images,positions,kw,name", [
    (random_images().float(), torch.arange(12), {}, "images"),
    (random_images()[0], torch.arange(12), {}, "images"),
    (random_images(), torch.arange(11), {}, "positions"),
    (random_images(), torch.arange(12, dtype=torch.int32), {}, "positions"),
    (random_images(), torch.arange(12) - 1, {}, "positions"),
    (random_images(), torch.arange(12), dict(seed=-1), "seed"),
    (random_images(), torch.arange(12), dict(seed=2**64), "seed"),
    (random_images(), torch.arange(12), dict(epoch=-1), "epoch"),
    (random_images(), torch.arange(12), dict(epoch=1.0), "epoch"),
    (random_images(h=10), torch.arange(12), dict(crop=11), "crop"),
    (random_images(c=4), torch.arange(12), dict(mean=IMAGENET["mean"]), "mean"),
])
def test_bad_inputs_raise_naming_the_argument(images, positions, kw, name):
    seed, epoch = kw.pop("seed", 0), kw.pop("epoch", 0)
    transform = GpuTransform(hflip=0.5, **kw)
    with pytest.raises(ValueError, match=rf"^{name}"):
        transform(images, positions, seed=seed, epoch=epoch)


# --- through a real server (RemoteDataLoader(gpu_transform=...), device=None) ---------------------

N_SERVED = 40


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from conftest import running_server
    from helpers import write_png

    root = tmp_path_factory.mktemp("finish-images")
    for i in range(N_SERVED):
        write_png(root / f"c{i % 3}" / f"img_{i:03d}.png", random_images(b=1, h=20, w=24, seed=100 + i)[0].numpy())
    with running_server(workers=2, cache_dir=tmp_path_factory.mktemp("cache"),
                        datasets={"pngs": {"kind": "imagefolder", "root": str(root)}}) as s:
        yield s


def served(server, finish=None, epochs=1, **kwargs) -> list[tuple[int, dict]]:
    """(epoch, batch) of ``epochs`` passes, batches copied out of the loader's memory."""
    import batchd

    kwargs = dict(batch_size=8, shuffle=True, seed=77) | kwargs
    out = []
    with batchd.RemoteDataLoader(server.address, "pngs", gpu_transform=finish, **kwargs) as loader:
        for _ in range(epochs):
            epoch = loader.epoch
            out += [(epoch, {k: v.clone() for k, v in batch.items()}) for batch in loader]
    return out


FINISH = dict(**IMAGENET, dtype=torch.bfloat16, hflip=0.5, vflip=0.5, crop=(16, 20))


def test_the_loader_finishes_each_batch_as_the_reference_does(server):
    from batchd.sampler import global_positions

    plain = served(server, epochs=2)
    finished = served(server, GpuTransform(**FINISH), epochs=2)
    assert len(plain) == len(finished) == 2 * 5
    by_epoch: dict[int, list[np.ndarray]] = {0: [], 1: []}
    for b, ((epoch, raw), (same_epoch, out)) in enumerate(zip(plain, finished)):
        assert epoch == same_epoch and torch.equal(raw["index"], out["index"])
        assert out["position"].tolist() == global_positions(8 * (b % 5), 8 * (b % 5) + 8, rank=0, world_size=1).tolist()
        assert out["image"].dtype == torch.bfloat16 and out["image"].shape == (8, 3, 16, 20)
        expected = reference(raw["image"].numpy(), out["position"].tolist(), seed=77, epoch=epoch, **FINISH)
        np.testing.assert_array_equal(as_numpy(out["image"]), expected)
        by_epoch[epoch].append(as_numpy(out["image"]))
    # another epoch: another shuffle, and other draws for the same positions
    assert not np.array_equal(np.concatenate(by_epoch[0]), np.concatenate(by_epoch[1]))


def test_a_position_is_finished_alike_whatever_the_batch_size_and_world_size(server):
    finish = GpuTransform(**FINISH)
    runs = [served(server, finish, batch_size=16)]
    runs.append(served(server, finish, batch_size=5, world_size=2, rank=0) + served(server, finish, batch_size=3,
                                                                                  world_size=2, rank=1))
    seen = []
    for run in runs:
        samples = {}
        for _, batch in run:
            for p, i, image in zip(batch["position"].tolist(), batch["index"].tolist(), as_numpy(batch["image"])):
                samples[p] = (i, image.tobytes())
        seen.append(samples)
    assert sorted(seen[0]) == sorted(seen[1]) == list(range(N_SERVED))
    assert seen[0] == seen[1]
    unflipped = served_unflipped(server)
    changed = sum(seen[0][p][1] != unflipped[p] for p in unflipped)
    assert changed > N_SERVED // 2, f"only {changed} of {N_SERVED} served samples were flipped or cropped off the corner"


def served_unflipped(server) -> dict[int, bytes]:
    """position -> finished bytes with the crop fixed at the top-left corner and no flips."""
    out = {}
    for _, batch in served(server, GpuTransform(**IMAGENET, dtype=torch.bfloat16), batch_size=16):
        for p, image in zip(batch["position"].tolist(), as_numpy(batch["image"])):
            out[p] = np.ascontiguousarray(image[:, :16, :20]).tobytes()
    return out


def test_the_batched_gather_of_the_gpu_equals_the_per_sample_slices_of_the_cpu():
    from batchd.client.device.finish import _crop_flip

    images = random_images(b=32, h=21, w=26)
    for transform in (GpuTransform(hflip=0.5, vflip=0.5, crop=(13, 17)), GpuTransform(hflip=0.5, vflip=0.5)):
        h, w = transform.crop or (21, 26)
        p = transform.params(torch.arange(32) * 3, seed=1, epoch=2, height=21, width=26)
        assert p.hflip.any() and not p.hflip.all() and p.vflip.any() and not p.vflip.all()
        assert torch.equal(_crop_flip(images, p, h, w, gather=True), _crop_flip(images, p, h, w, gather=False))
