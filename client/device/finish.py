"""``GpuTransform``: the last steps of an image pipeline, batched, on the device the batch is on.

``RemoteDataLoader(..., gpu_transform=GpuTransform(...))`` calls it right after the
host-to-device copy (on the copy's side stream; on CPU tensors with ``device=None``)::

    batch["image"] = gpu_transform(batch["image"], batch["position"], seed=loader.seed, epoch=epoch)

What it does, in this order, for uint8 images [B, H, W, C]:

1. a random crop of ``crop`` = (h, w) per sample, then random horizontal and vertical flips per
   sample: one gather of uint8 pixels (crop and flips are folded into the row and column indices);
2. layout, dtype and normalisation in one more gather, through a lookup table of the 256 possible
   values of each channel. The table is ``arange(256).float().div(255).sub(mean).div(std).to(dtype)``
   computed on the CPU, so the output is bit for bit what this gives on the CPU (same ops, each
   correctly rounded)::

       x.permute(0, 3, 1, 2).float().div(255).sub(mean.view(1, C, 1, 1)).div(std.view(1, C, 1, 1)).to(dtype)

   with ``mean``/``std`` float32 tensors -- on every device. (On CUDA that expression itself may
   differ in the last bit: PyTorch divides by a scalar there as a multiplication by its reciprocal.)

Randomness is a pure function of (seed, epoch, position): the sample's position in the epoch's
global order (``batchd.sampler.global_positions``), not of batch size, rank, batch composition or
device. One Philox4x32-10 block per sample (``philox4x32``, torch integer ops on the images'
device, no global RNG, no host synchronisation) gives four 32-bit words, one per operation in
turn: word 0 horizontal flip, 1 vertical flip, 2 crop top, 3 crop left. Its key is
``SeedSequence([seed, epoch], spawn_key=(2,))`` -- a sibling of the server's augmentation key
(``spawn_key=(1,)``, ``batchd.sampler.sample_key``) and a child of the shuffle's sequence, so the
three share no state. The counter is (position mod 2**32, position // 2**32, 0, 0).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

__all__ = ["FinishParams", "GpuTransform", "finish_key", "philox4x32"]

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_M0, _M1 = 0xD2511F53, 0xCD9E8D57  # Philox4x32 multipliers (Salmon et al., SC'11; Random123)
_W0, _W1 = 0x9E3779B9, 0xBB67AE85  # its Weyl key increments
_MASK16, _MASK32 = 0xFFFF, 0xFFFFFFFF


def finish_key(*, seed: int, epoch: int) -> tuple[int, int]:
    """The Philox4x32 key (two 32-bit ints) of one epoch's finishing draws.

    ``SeedSequence([seed, epoch], spawn_key=(2,)).generate_state(2, uint32)``. Raises ValueError
    if seed is not in [0, 2**64) or epoch is negative.
    """
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 1 << 64:
        raise ValueError(f"seed must be an integer in [0, 2**64), got {seed!r}")
    if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
        raise ValueError(f"epoch must be a non-negative integer, got {epoch!r}")
    k0, k1 = np.random.SeedSequence([seed, epoch], spawn_key=(2,)).generate_state(2, np.uint32).tolist()
    return k0, k1


def _mulhilo(m: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit halves of ``m * x``; x: int64 in [0, 2**32). No product exceeds 2**48."""
    p_lo = (x & _MASK16) * m
    p_hi = (x >> 16) * m
    t = ((p_hi & _MASK16) << 16) + p_lo
    return (p_hi >> 16) + (t >> 32), t & _MASK32


def philox4x32(counter: Sequence[torch.Tensor], key: tuple[int, int], rounds: int = 10) -> list[torch.Tensor]:
    """Philox4x32-``rounds`` of a batch of counters: four int64 tensors of 32-bit words.

    counter: four int64 tensors of one shape (any device), values in [0, 2**32); key: two ints
    in [0, 2**32). Returns the four output words, int64 in [0, 2**32), same shape and device.
    Matches Random123's known-answer vectors (tests/client/test_finish.py). Integer ops only, so the
    result is the same on every device.
    """
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for r in range(rounds):
        if r:
            k0, k1 = (k0 + _W0) & _MASK32, (k1 + _W1) & _MASK32
        hi0, lo0 = _mulhilo(_M0, c0)
        hi1, lo1 = _mulhilo(_M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return [c0, c1, c2, c3]


class FinishParams(NamedTuple):
    """Per-sample draws of a ``GpuTransform``: hflip, vflip bool [B]; top, left int64 [B] (pixels)."""

    hflip: torch.Tensor
    vflip: torch.Tensor
    top: torch.Tensor
    left: torch.Tensor


def _probability(name: str, p) -> float:
    if isinstance(p, bool) or not isinstance(p, int | float) or not 0.0 <= p <= 1.0:
        raise ValueError(f"{name} must be a probability in [0, 1], got {p!r}")
    return float(p)


def _channels(name: str, values) -> tuple[float, ...] | None:
    if values is None:
        return None
    if isinstance(values, int | float):
        values = (values,)
    try:
        values = tuple(float(v) for v in values)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a sequence of numbers (one per channel), got {values!r}") from None
    if not values or not all(math.isfinite(v) for v in values):
        raise ValueError(f"{name} must be a non-empty sequence of finite numbers, got {values!r}")
    return values


class GpuTransform:
    """Crop, flip, layout, dtype and normalisation of a batch of images, batched, on their device.

    Args (keyword only):
        mean, std: per-channel mean and standard deviation in units of ``image / 255`` (as with
            torchvision's ``Normalize`` after ``ToTensor``, e.g. ImageNet's (0.485, 0.456, 0.406)
            and (0.229, 0.224, 0.225)); a single number applies to every channel. Default 0 and 1
            (just ``/ 255``). std must be > 0; given both, they must have the same length.
        dtype: torch.float32 (default), torch.float16 or torch.bfloat16 (or their names).
        channels_last: return the NCHW tensor in ``torch.channels_last`` memory format (NHWC in
            memory, what cuDNN convolutions prefer with bf16/fp16); default contiguous NCHW.
        hflip, vflip: probability of flipping each sample left-right / upside-down (default 0).
        crop: None (whole image), an int (square) or (height, width): a random crop of that size
            per sample, its top-left corner uniform over all positions that fit.

    Call: ``transform(images, positions, *, seed, epoch)`` with images uint8 [B, H, W, C] and
    positions int64 [B] (on the images' device, or the CPU) returns ``dtype`` [B, C, h, w] on the
    images' device, where (h, w) is ``crop`` or (H, W); a batch whose every sample was skipped
    (images [0, H, W, C], also [0, 0, 0, C]) gives [0, C, h, w]. See the module docstring for the
    exact arithmetic and how the draws are derived.

    Thread-safe (the receiver threads of a several-servers loader share one). Raises ValueError
    naming the argument for bad settings (at construction) or bad inputs (at
    call: wrong dtype or rank, a crop larger than the image, a channel count other than that of
    mean/std, positions of another length, a bad seed or epoch).
    """

    def __init__(self, *, mean: Sequence[float] | float | None = None, std: Sequence[float] | float | None = None,
                 dtype: torch.dtype | str = torch.float32, channels_last: bool = False, hflip: float = 0.0,
                 vflip: float = 0.0, crop: int | tuple[int, int] | None = None):
        self.mean, self.std = _channels("mean", mean), _channels("std", std)
        if self.std is not None and not all(s > 0 for s in self.std):
            raise ValueError(f"std must be positive, got {self.std}")
        if self.mean is not None and self.std is not None and len(self.mean) != len(self.std):
            raise ValueError(f"mean and std must have one value per channel, got {len(self.mean)} and {len(self.std)}")
        dtype = _DTYPES.get(dtype, dtype) if isinstance(dtype, str) else dtype
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype must be torch.float32, torch.float16 or torch.bfloat16, got {dtype!r}")
        self.dtype = dtype
        if not isinstance(channels_last, bool):
            raise ValueError(f"channels_last must be a bool, got {channels_last!r}")
        self.channels_last = channels_last
        self.hflip, self.vflip = _probability("hflip", hflip), _probability("vflip", vflip)
        if crop is not None:
            size = (crop, crop) if isinstance(crop, int) and not isinstance(crop, bool) else crop
            if (not isinstance(size, tuple | list) or len(size) != 2
                    or not all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in size)):
                raise ValueError(f"crop must be None, a positive int or (height, width) of positive ints, got {crop!r}")
            crop = (size[0], size[1])
        self.crop: tuple[int, int] | None = crop
        self._luts: dict[tuple[torch.device, int], torch.Tensor] = {}
        self._key: tuple[tuple[int, int], tuple[int, int]] | None = None

    def __repr__(self) -> str:
        return (f"GpuTransform(mean={self.mean}, std={self.std}, dtype={self.dtype}, channels_last={self.channels_last}, "
                f"hflip={self.hflip}, vflip={self.vflip}, crop={self.crop})")

    # --- draws -------------------------------------------------------------------------------

    def _finish_key(self, seed: int, epoch: int) -> tuple[int, int]:
        cached = self._key  # one read: receiver threads of several servers may call at once
        if cached is None or cached[0] != (seed, epoch):
            cached = self._key = ((seed, epoch), finish_key(seed=seed, epoch=epoch))
        return cached[1]

    def params(self, positions: torch.Tensor, *, seed: int, epoch: int, height: int, width: int) -> FinishParams:
        """The draws for samples at ``positions`` (int64 [B]) of images ``height`` x ``width``.

        Returns a FinishParams on positions' device: whether each sample is flipped, and the crop's
        top-left corner (0 without crop). Useful to transform boxes or keypoints alike. Raises
        ValueError for a bad seed, epoch or positions, or a crop larger than height x width.
        """
        if not isinstance(positions, torch.Tensor) or positions.dtype != torch.int64 or positions.dim() != 1:
            raise ValueError(f"positions must be an int64 tensor [B], got {_describe(positions)}")
        if positions.device.type == "cpu" and positions.numel() and int(positions.min()) < 0:
            raise ValueError(f"positions must be non-negative, got {int(positions.min())}")
        k = self._finish_key(seed, epoch)
        h, w = self.crop or (height, width)
        if h > height or w > width:
            raise ValueError(f"crop {self.crop} is larger than the images ({height}x{width})")
        zero = torch.zeros_like(positions)
        words = philox4x32((positions & _MASK32, positions >> 32, zero, zero), k)
        return FinishParams(
            hflip=words[0] < round(self.hflip * 2**32),  # exact probability: round(p * 2**32) / 2**32
            vflip=words[1] < round(self.vflip * 2**32),
            top=(words[2] * (height - h + 1)) >> 32,  # Lemire's multiply-shift: bias <= (H - h + 1) / 2**32
            left=(words[3] * (width - w + 1)) >> 32,
        )

    # --- the transform -------------------------------------------------------------------------

    def _lut(self, device: torch.device, channels: int) -> torch.Tensor:
        """``dtype`` [channels * 256]: entry c * 256 + v is channel c's output for value v."""
        lut = self._luts.get((device, channels))
        if lut is None:
            for name, values in (("mean", self.mean), ("std", self.std)):
                if values is not None and len(values) not in (1, channels):
                    raise ValueError(f"{name} has {len(values)} values but the images have {channels} channels")
            mean = torch.tensor(self.mean or (0.0,), dtype=torch.float32).expand(channels).reshape(channels, 1)
            std = torch.tensor(self.std or (1.0,), dtype=torch.float32).expand(channels).reshape(channels, 1)
            values = torch.arange(256, dtype=torch.float32).expand(channels, 256)
            table = values.div(255).sub(mean).div(std).to(self.dtype)  # on the CPU, as the docstring says
            lut = self._luts[(device, channels)] = table.reshape(-1).to(device)
        return lut

    def __call__(self, images: torch.Tensor, positions: torch.Tensor, *, seed: int, epoch: int) -> torch.Tensor:
        """``dtype`` [B, C, h, w] on images' device; see the class docstring."""
        if not isinstance(images, torch.Tensor) or images.dtype != torch.uint8 or images.dim() != 4:
            raise ValueError(f"images must be a uint8 tensor [B, H, W, C], got {_describe(images)}")
        b, height, width, channels = images.shape
        if not isinstance(positions, torch.Tensor) or positions.shape != (b,):
            raise ValueError(f"positions must be an int64 tensor [{b}] (one per image), got {_describe(positions)}")
        lut = self._lut(images.device, channels)
        self._finish_key(seed, epoch)  # the same argument checks with or without draws
        h, w = self.crop or (height, width)
        if b == 0:  # every sample of the batch was skipped (on_error: skip): its images may be [0, 0, 0, C]
            out = torch.empty((0, channels, h, w), dtype=self.dtype, device=images.device)
            return out.contiguous(memory_format=torch.channels_last) if self.channels_last else out
        if self.hflip or self.vflip or self.crop is not None:
            p = self.params(positions, seed=seed, epoch=epoch, height=height, width=width)
            p = FinishParams(*(t.to(images.device, non_blocking=True) for t in p))
            images = _crop_flip(images, p, h, w)
        offsets = torch.arange(0, 256 * channels, 256, dtype=torch.int32, device=images.device)
        # index_select, not lut[index]: 3x faster on the CPU (bench/cuda/cuda_finish.py --cpu)
        if self.channels_last:
            index = torch.empty((b, h, w, channels), dtype=torch.int32, device=images.device)
            torch.add(images, offsets, out=index)
            return lut.index_select(0, index.view(-1)).view(b, h, w, channels).permute(0, 3, 1, 2)
        index = torch.empty((b, channels, h, w), dtype=torch.int32, device=images.device)
        torch.add(images.permute(0, 3, 1, 2), offsets.view(channels, 1, 1), out=index)
        return lut.index_select(0, index.view(-1)).view(b, channels, h, w)


def _crop_flip(images: torch.Tensor, p: FinishParams, h: int, w: int, gather: bool | None = None) -> torch.Tensor:
    """uint8 [B, h, w, C]: each image's crop at (top, left), flipped as drawn.

    gather (default: on a GPU): one batched gather, crop and flips folded into row and column
    indices; else a slice per sample, 8x faster than that gather on the CPU (batch 64, 256x256).
    """
    if not (images.device.type != "cpu" if gather is None else gather):
        out = torch.empty((images.shape[0], h, w, images.shape[3]), dtype=torch.uint8)
        for k, (top, left, hflip, vflip) in enumerate(zip(*(t.tolist() for t in (p.top, p.left, p.hflip, p.vflip)))):
            crop = images[k, top:top + h, left:left + w]
            flips = [d for d, f in ((0, vflip), (1, hflip)) if f]
            out[k] = crop.flip(flips) if flips else crop
        return out
    i = torch.arange(h, device=images.device)
    j = torch.arange(w, device=images.device)
    rows = p.top[:, None] + torch.where(p.vflip[:, None], h - 1 - i, i)  # [B, h]
    cols = p.left[:, None] + torch.where(p.hflip[:, None], w - 1 - j, j)  # [B, w]
    batch = torch.arange(images.shape[0], device=images.device)[:, None, None]
    return images[batch, rows[:, :, None], cols[:, None, :]]


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"{x.dtype} tensor of shape {list(x.shape)} on {x.device}"
    return type(x).__name__
