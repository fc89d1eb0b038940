"""Decode only what the pipeline keeps: a first random crop drawn, then only its window decoded, at its scale.

A pipeline whose first transform is of the crop-then-resize family (``FIRST_STEPS``:
``RandomResizedCrop``, ``RandomSizedCrop``) keeps a random window of the decoded image, resized
to an output size. (A first resize, ``Resize``, ``LongestMaxSize`` or ``SmallestMaxSize``, draws
nothing and keeps the whole image: the image is decoded at the cheapest M/8 that still gives its
output size, ``pipeline.decode_min_size``, and that decode may be cached with the resize.) With
``reduced_decode`` on, a worker builds such a sample (server/compute/worker.py) as DALI's
``decoders.image_random_crop`` does:

1. **Draw first.** The sample's stream is started (``SampleRandom.start``) and the draws that
   ``Compose.__call__`` and the first transform make are made here, in albumentations' own order
   and with its own code (``draw``): the Compose's ``random() < p``, the transform's
   ``should_apply``, ``get_params``, ``update_transform_params`` and
   ``get_params_dependent_on_data``, on a stand-in image of the full decode's shape (read from
   the JPEG's headers, ``Dataset.decoded_size``: EXIF orientation 5-8 swap it). The same
   stream and the same shape give the same ``params`` (``crop_coords``) as a full decode, and
   leave the stream where the full decode's first transform leaves it. Since the decode depends
   on the draw, such a sample is never served from the decoded-sample cache (cache or not, the
   same bytes); ``reduced_decode: false`` caches full decodes instead. The cache keeps the
   sample's indexed JPEG (``scaled_jpeg.index_jpeg``), from which step 2 reads only the
   window's MCUs, the same bytes.
2. **Decode only the window, at the scale it needs**: the cheapest factor m/8 at which the window
   is still at least the output size (``scaled_jpeg.cheapest``; 1/8, 1/4, 1/2 or 1/1 on
   libjpeg-turbo 2.1, whose other M/8 factors cost more than the next power of two above them),
   and of the image at that scale only the MCUs covering the window and 2 pixels around it
   (``Drawn.rect``; ``scaled_jpeg.decode_region``: rows above skipped, columns cut, nothing
   below decoded). A turned JPEG (EXIF orientation 2-8), or a server built without the region
   decoder, decodes the whole image at m/8 and cuts the rectangle from it.
3. **The first transform, in two halves** (``TargetPipeline.end_first``): its image is the
   window of the scaled image resampled to the output size with the transform's interpolation
   (``resample``: one ``cv2.warpAffine`` with the exact sub-pixel map from output pixels to the
   scaled image, so the window is neither shifted nor cut at the scaled image's pixel grid);
   its masks, boxes and keypoints come from the transform's own ``apply_with_params`` with the
   ``params`` of step 1 on the full frame: equal to a full decode's. At m = 8 the image is the
   transform's own ``apply`` on the rectangle (its pixels a full decode's but at the rectangle's
   edges, where libjpeg upsamples chroma without the next block: a few levels at most). A
   sample whose size cannot be read without decoding it (not a JPEG) is built as without
   reduced decoding.
4. **The rest of the Compose** as one ``Compose.__call__`` runs it (``TargetPipeline``): every
   later transform draws from the stream exactly as after a full decode.

So only the decode's precision differs: a scaled decode averages each 8 x 8 block's pixels in the
DCT domain before the bilinear resize, where a full decode's bilinear resize of a window 2-8x the
output skips pixels (aliasing). ``PIXEL_BOUND``: the bound tests/compute/test_region.py holds
it to (PSNR of the first transform's output against ``reduced_decode: false``, photos).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import albumentations as A
import cv2
import numpy as np

from batchd.server.data import scaled_jpeg

FIRST_STEPS = (A.RandomResizedCrop, A.RandomSizedCrop)  # params["crop_coords"], output self.size
# PSNR (dB) of a reduced decode's first-transform output against a full decode's, over photos
PIXEL_BOUND = {"mean_psnr_db": 32.0, "min_psnr_db": 20.0}
_WARPS = {cv2.INTER_NEAREST: cv2.INTER_NEAREST, cv2.INTER_NEAREST_EXACT: cv2.INTER_NEAREST,
          cv2.INTER_LINEAR: cv2.INTER_LINEAR, cv2.INTER_LINEAR_EXACT: cv2.INTER_LINEAR,
          cv2.INTER_CUBIC: cv2.INTER_CUBIC}
_STAND_IN = np.zeros((1, 1, 1), np.uint8)


@dataclass(frozen=True, slots=True)
class Drawn:
    """What the first transform drew for one sample, and the decode it needs.

    params: the transform's params as albumentations computes them on the full frame (with
        ``shape``), or None when its own ``p`` draw skipped it.
    shape: (height, width) of the full decode.
    window: (x1, y1, x2, y2) it keeps, full-frame pixels; out: (height, width) it resizes it to.
    interpolation: the OpenCV flag its ``apply`` would use for the image.
    eighths: the m of the factor m/8 to decode at (8: full size).
    rect: (x, y, w, h), the rectangle of the image decoded at m/8 that is decoded
        (``scaled_jpeg.scaled_window``: the window and 2 pixels around it).
    """

    params: dict[str, Any] | None
    shape: tuple[int, int]
    window: tuple[int, int, int, int]
    out: tuple[int, int]
    interpolation: int
    eighths: int
    rect: tuple[int, int, int, int]


class FirstStep:
    """The first transform of ``compose`` (a ``FIRST_STEPS`` type, the Compose at p = 1), drawn
    ahead of decoding. ``of`` returns None for any other pipeline."""

    def __init__(self, compose: A.Compose):
        self.compose = compose
        self.transform = compose.transforms[0]

    @classmethod
    def of(cls, compose: A.Compose | None) -> "FirstStep | None":
        if compose is None or not compose.transforms or getattr(compose, "p", 1.0) < 1.0:
            return None
        if type(compose.transforms[0]) not in FIRST_STEPS:  # exact types: a subclass may draw otherwise
            return None
        return cls(compose)

    def draw(self, height: int, width: int) -> Drawn:
        """Draw what ``Compose.__call__`` and its first transform draw for an image ``height`` x
        ``width`` (RGB) from the stream the transforms are attached to (started for the sample),
        and choose the decode scale."""
        self.compose.py_random.random()  # Compose.__call__'s `random() < p` (p is 1)
        t = self.transform
        full = (height, width)
        if not t.should_apply():
            return Drawn(None, full, (0, 0, width, height), full, cv2.INTER_LINEAR, 8, (0, 0, width, height))
        stand_in = {"image": np.broadcast_to(_STAND_IN, (height, width, 3))}
        params = t.get_params()
        params = t.update_transform_params(params=params, data=stand_in)
        params.update(t.get_params_dependent_on_data(params=params, data=stand_in))
        window = tuple(int(v) for v in params["crop_coords"])
        out = (int(t.size[0]), int(t.size[1]))
        crop = (window[3] - window[1], window[2] - window[0])
        interpolation = t._get_interpolation_for_resize(crop, "image")
        h, w = window[3] - window[1], window[2] - window[0]
        need = max(out[0] / max(h, 1), out[1] / max(w, 1))
        m = scaled_jpeg.cheapest(need)
        return Drawn(params, full, window, out, interpolation, m, scaled_jpeg.scaled_window(window, m, height, width))

    def image(self, image: np.ndarray, drawn: Drawn) -> np.ndarray:
        """The first transform's image output, from ``image``: the rectangle ``drawn.rect`` of the
        image decoded at ``drawn.eighths``/8 (the whole image when the transform's own p skipped
        it). At full size, the transform's own ``apply`` on it (its window moved by the
        rectangle's corner). Raises ValueError if ``image`` is not the rectangle's size."""
        if drawn.params is None:
            return image
        x, y, w, h = drawn.rect
        if image.shape[:2] != (h, w):
            raise ValueError(f"the {w}x{h} rectangle at ({x}, {y}) of an image decoded at {drawn.eighths}/8 of "
                             f"{drawn.shape[1]}x{drawn.shape[0]} was expected, got {image.shape[1]}x{image.shape[0]}")
        if drawn.eighths == 8:
            x1, y1, x2, y2 = drawn.window
            return self.transform.apply(image, **{**drawn.params, "crop_coords": (x1 - x, y1 - y, x2 - x, y2 - y)})
        return resample(image, drawn.eighths / 8, drawn.window, drawn.out, drawn.interpolation, (x, y))


def resample(scaled: np.ndarray, factor: float, window: tuple[int, int, int, int], out: tuple[int, int],
             interpolation: int, origin: tuple[int, int] = (0, 0)) -> np.ndarray:
    """The window ``(x1, y1, x2, y2)`` (full-frame pixels) of an image decoded at ``factor`` of its
    size, resized to ``out`` (height, width): uint8 [out_h, out_w, C]. ``scaled`` holds the
    scaled image's pixels from ``origin`` (x, y) on (a rectangle of it).

    Pixel centres as OpenCV's ``resize`` places them on the full frame's window, x_full = x1 +
    (u + 0.5) * w / out_w - 0.5, mapped to the scaled image as libjpeg's scaled inverse DCT
    places its pixels (each the mean of 1/factor full pixels): x_scaled = (x_full + 0.5) *
    factor - 0.5. Nearest, linear and cubic interpolations warp with that map
    (``cv2.warpAffine``, borders replicated); area and Lanczos resize the window's covering
    pixels (the window rounded to the scaled grid, ``cv2.resize``)."""
    x1, y1, x2, y2 = window
    ox, oy = origin
    out_h, out_w = out
    sx, sy = (x2 - x1) / out_w, (y2 - y1) / out_h
    warp = _WARPS.get(interpolation)
    if warp is None:
        h, w = scaled.shape[:2]
        cx1, cy1 = min(w - 1, int(round(x1 * factor)) - ox), min(h - 1, int(round(y1 * factor)) - oy)
        cx2 = max(cx1 + 1, min(w, int(round(x2 * factor)) - ox))
        cy2 = max(cy1 + 1, min(h, int(round(y2 * factor)) - oy))
        return cv2.resize(scaled[max(0, cy1):cy2, max(0, cx1):cx2], (out_w, out_h), interpolation=interpolation)
    matrix = np.array([[sx * factor, 0.0, (x1 + 0.5 * sx) * factor - 0.5 - ox],
                       [0.0, sy * factor, (y1 + 0.5 * sy) * factor - 0.5 - oy]])
    return cv2.warpAffine(scaled, matrix, (out_w, out_h), flags=warp | cv2.WARP_INVERSE_MAP,
                          borderMode=cv2.BORDER_REPLICATE)
