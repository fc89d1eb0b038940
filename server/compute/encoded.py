"""JPEG batches: the samples' files as they are, for the client to decode (``image_encoding`` JPEG).

A client that decodes on its GPU (nvJPEG) asks for ``IMAGE_ENCODING_JPEG``: the server then only
reads each sample's bytes, checks that they are a JPEG the client can decode, and lays the files
back to back in the batch's slot, ragged as flat + offsets (as Arrow does):

* ``label``, ``index``, ``position`` int64 [B], as in a decoded batch (first, so that
  ``tensors[0].shape[0]`` is still the batch's size);
* ``jpeg_offsets`` int64 [B + 1]: sample i is ``jpeg[jpeg_offsets[i]:jpeg_offsets[i + 1]]``;
* ``jpeg_resize`` int64 [2]: (height, width) the client resizes every image to, (0, 0) for none;
* ``jpeg_reduce`` int64 [B]: 1, 2, 4 or 8, the libjpeg DCT scaling the server would have decoded
  sample i at (``reduced_decode``: a JPEG at least twice the Resize is decoded at 1/2, 1/4 or
  1/8); a CPU decoder that wants the server's bytes decodes at 1/n (``cv2.IMREAD_REDUCED_COLOR_n``);
* ``jpeg`` uint8 [total bytes].

``check_request`` (called by ``Loader.open_stream``) accepts it only for datasets read from
storage (``read_bytes``) and a pipeline the client can redo exactly: none, or one
``Resize(height, width)`` with OpenCV's INTER_LINEAR (the server's decode + albumentations Resize
are then ``cv2.imdecode`` + ``cv2.cvtColor`` + ``cv2.resize``). ``build_batch`` runs in a worker
(``server/compute/worker.py`` hands it JPEG tasks); the decoded-sample cache is not used.
"""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING, Any

import cv2
import numpy as np

from batchd.errors import ResourceExhaustedError, SampleError
from batchd.server.compute import pipeline as pipelines
from batchd.server.compute import python_pipeline
from batchd.server.data.datasets import Dataset
from batchd.server.data.decode import ImageReadError, decode_flag, jpeg_frame, jpeg_truncated
from batchd.server.compute.layout import jpeg_layout, layout_nbytes
from batchd.server.compute.protocol import BatchDone, Task
from batchd.server.compute.stages import READ, WRITE

if TYPE_CHECKING:
    from batchd.server.compute.worker import _Worker

# SOFn markers: those nvJPEG and OpenCV both decode (Huffman-coded, 8-bit), and the others by name
_DECODABLE = {0xC0: "baseline", 0xC1: "extended sequential", 0xC2: "progressive"}
_OTHER_FRAMES = {
    0xC3: "lossless", 0xC5: "differential sequential", 0xC6: "differential progressive", 0xC7: "differential lossless",
    0xC9: "arithmetic-coded sequential", 0xCA: "arithmetic-coded progressive", 0xCB: "arithmetic-coded lossless",
    0xCD: "differential arithmetic-coded sequential", 0xCE: "differential arithmetic-coded progressive",
    0xCF: "differential arithmetic-coded lossless",
}
_REDUCTIONS = {cv2.IMREAD_REDUCED_COLOR_2: 2, cv2.IMREAD_REDUCED_COLOR_4: 4, cv2.IMREAD_REDUCED_COLOR_8: 8}
_SIGNATURES = ((b"\x89PNG\r\n\x1a\n", "PNG"), (b"GIF87a", "GIF"), (b"GIF89a", "GIF"), (b"BM", "BMP"),
               (b"RIFF", "RIFF/WebP"), (b"II*\x00", "TIFF"), (b"MM\x00*", "TIFF"))


def check_request(ds: Dataset, encoding: str, pipeline_json: str) -> tuple[int, int]:
    """Whether a stream of ``ds`` may use ``encoding`` with this pipeline (canonical JSON, "" for none).

    Returns the (height, width) the client resizes to, (0, 0) for none (also for "decoded").
    Raises ValueError (INVALID_ARGUMENT) for JPEG when the dataset has no files to send (its
    samples are in memory), has fields besides image and label (targets the server must move
    with the image), or the pipeline is not empty or exactly one Resize with INTER_LINEAR,
    naming the transform the server would have to run on pixels.
    """
    if encoding == "decoded":
        return 0, 0
    if encoding != "jpeg":
        raise ValueError(f"image_encoding must be 'decoded' or 'jpeg', got {encoding!r}")
    if not ds.concurrent_reads:
        raise ValueError(
            f"image_encoding JPEG: dataset {ds.name!r} (kind {ds.kind}) holds decoded pixels, not encoded "
            "files the client could decode; ask for decoded images (decode_on_client=False)")
    others = [f.name for f in ds.fields if f.name not in ("image", "label")]
    if others:
        raise ValueError(
            f"image_encoding JPEG: dataset {ds.name!r} has targets or other fields ({', '.join(others)}) that the "
            "server's pipeline must move with the image; the client decodes images only: ask for decoded samples "
            "(decode_on_client=False)")
    if python_pipeline.is_python(pipeline_json):
        raise ValueError("image_encoding JPEG: the pipeline is a python preset, which runs on the server's pixels; "
                         "ask for decoded images (decode_on_client=False)")
    return resize_of(pipelines.build(pipeline_json))


def resize_of(compose: Any) -> tuple[int, int]:
    """(height, width) of a pipeline that is exactly one INTER_LINEAR ``Resize``; (0, 0) for none.

    Raises ValueError naming the first transform a client cannot redo exactly.
    """
    import albumentations as A

    if compose is None or not compose.transforms:
        return 0, 0
    how = ("with image_encoding JPEG the pipeline must be empty or exactly one Resize(height, width) with "
           "interpolation INTER_LINEAR (the client redoes it); run the rest on the client (gpu_transform) or "
           "ask for decoded images (decode_on_client=False)")
    first = compose.transforms[0]
    name = type(first).__name__
    if len(compose.transforms) > 1:
        other = type(compose.transforms[1]).__name__ if isinstance(first, A.Resize) else name
        raise ValueError(f"image_encoding JPEG: the server would have to run {other} on pixels; {how}")
    if type(first) is not A.Resize:
        raise ValueError(f"image_encoding JPEG: the server would have to run {name} on pixels; {how}")
    if first.interpolation != cv2.INTER_LINEAR or getattr(first, "area_for_downscale", None) is not None:
        raise ValueError(f"image_encoding JPEG: Resize with interpolation={first.interpolation}, "
                         f"area_for_downscale={getattr(first, 'area_for_downscale', None)!r}; {how}")
    if first.p < 1.0 or compose.p < 1.0:
        raise ValueError(f"image_encoding JPEG: Resize applied with probability {min(first.p, compose.p)} "
                         f"(random); {how}")
    return int(first.height), int(first.width)


def check_jpeg(data: Any, max_pixels: int | None = None) -> tuple[np.ndarray, tuple[int, int]]:
    """The bytes of one sample as uint8 [N] and its (width, height), if they are a JPEG the client
    can decode.

    That is: a SOI marker, then a Huffman-coded 8-bit frame (baseline, extended sequential or
    progressive, SOF0/1/2) with 1 or 3 components, an end-of-image marker after the last scan,
    and at most ``max_pixels`` pixels. Raises ImageReadError whose reason names what is wrong
    (``empty file (0 bytes)``, ``a PNG file, not a JPEG ...``, ``JPEG frame type SOF3
    (lossless) ...``, ``truncated JPEG ...``, ``image too large ...``).
    """
    buf = data if isinstance(data, np.ndarray) else np.frombuffer(data, dtype=np.uint8)
    buf = buf.reshape(-1)
    if buf.size == 0:
        raise ImageReadError("empty file (0 bytes)")
    head = buf[:16].tobytes()
    if not head.startswith(b"\xff\xd8"):
        kind = next((k for sig, k in _SIGNATURES if head.startswith(sig)), None)
        what = f"a {kind} file" if kind else f"no JPEG SOI marker (starts with {head[:4].hex(' ')})"
        raise ImageReadError(f"{what}, not a JPEG ({buf.size} bytes); image_encoding JPEG sends only JPEG files "
                             "(decode on the server for other formats)")
    width, height = _frame(buf)
    if jpeg_truncated(buf):
        raise ImageReadError(f"truncated JPEG: no end-of-image marker after the last scan ({buf.size} bytes)")
    if max_pixels is not None and width * height > max_pixels:
        raise ImageReadError(f"image too large: {width}x{height} = {width * height} pixels > max_pixels {max_pixels}")
    return buf, (width, height)


def _frame(buf: np.ndarray) -> tuple[int, int]:
    """(width, height) of a JPEG's frame header after checking its type; raises ImageReadError."""
    mv = memoryview(buf)
    frame = jpeg_frame(mv)
    if frame is None:
        raise ImageReadError(f"JPEG without a readable frame header ({buf.size} bytes)")
    marker, pos = frame
    if marker not in _DECODABLE:
        raise ImageReadError(
            f"JPEG frame type SOF{marker - 0xC0} ({_OTHER_FRAMES[marker]}) cannot be decoded by the "
            "client (baseline, extended or progressive Huffman-coded only)")
    try:
        precision, height, width, components = struct.unpack_from(">BHHB", mv, pos + 4)
    except struct.error:
        raise ImageReadError(f"JPEG without a readable frame header ({buf.size} bytes)") from None
    if precision != 8:
        raise ImageReadError(f"{precision}-bit JPEG cannot be decoded by the client (8-bit only)")
    if components not in (1, 3):
        raise ImageReadError(f"JPEG with {components} components (CMYK/YCCK?) cannot be decoded by the "
                             "client (1 or 3 only)")
    if not width or not height:
        raise ImageReadError(f"JPEG frame header gives {width}x{height} pixels")
    return width, height


def _read(worker: "_Worker", ds: Dataset, task: Task, k: int, index: int) -> Any:
    """Sample k's bytes: from the worker's reader if they were read ahead, else read now."""
    if task.task_id not in worker.reader:
        return ds.read_bytes(index)
    worker.between_samples()
    data = worker.reader.take(task.task_id, k, worker.between_samples)
    return ds.read_bytes(index) if data is None else data


def build_batch(worker: "_Worker", task: Task) -> BatchDone:
    """Build ``task``'s JPEG batch in its slot (or a grown segment). Runs in a worker process.

    Raises SampleError naming dataset, index and file for a sample that cannot be read or is not
    a JPEG the client can decode (unless ``task.skip_bad_samples``: it is left out and reported
    in ``BatchDone.skipped``); ResourceExhaustedError over ``task.max_batch_bytes``.
    """
    ds = worker.dataset(task.dataset)
    compose, min_size = worker.pipeline(task.pipeline_key, task.pipeline_json)
    resize = resize_of(compose)
    if not getattr(ds, "reduced_decode", False):
        min_size = None  # the server decodes this dataset at full size
    max_pixels = getattr(ds, "max_pixels", None)
    worker.prefetch(task)  # no-op if it came ahead of time
    worker.clock.enter(READ)  # the files are read (the stall) and checked, not decoded
    files: list[np.ndarray] = []
    kept: list[tuple[int, int, int]] = []  # (index, position, DCT reduction)
    skipped: list[tuple[int, str, str]] = []
    for k, (index, position) in enumerate(zip(task.indices.tolist(), task.positions.tolist())):
        try:
            try:
                buf, size = check_jpeg(_read(worker, ds, task, k, index), max_pixels)
            except ImageReadError as e:
                raise ds.sample_error(index, e.reason) from None
        except SampleError as e:
            if not task.skip_bad_samples:
                raise
            skipped.append((index, e.path, e.reason))
            continue
        files.append(buf)
        kept.append((index, position, _REDUCTIONS.get(decode_flag(buf, size, min_size), 1)))
    worker.clock.enter(WRITE)
    offsets = np.zeros(len(files) + 1, np.int64)
    np.cumsum([f.size for f in files], out=offsets[1:])
    layout = jpeg_layout(len(files), int(offsets[-1]))
    nbytes = layout_nbytes(layout)
    if task.max_batch_bytes and nbytes > task.max_batch_bytes:
        raise ResourceExhaustedError(
            f"dataset {ds.name!r}: a JPEG batch of {len(files)} files is {nbytes} bytes, over the server's limit of "
            f"{task.max_batch_bytes} (max_batch_bytes); use a smaller batch_size")
    seg, grown = worker._slot(task, nbytes)
    tensors = {t.name: np.frombuffer(seg.buf, t.dtype, t.shape[0], t.offset) for t in layout}  # 1-D each
    tensors["label"][:] = [ds.label(i) for i, _, _ in kept]
    tensors["index"][:] = [i for i, _, _ in kept]
    tensors["position"][:] = [p for _, p, _ in kept]
    tensors["jpeg_reduce"][:] = [r for _, _, r in kept]
    tensors["jpeg_offsets"][:] = offsets
    tensors["jpeg_resize"][:] = resize
    jpeg = tensors["jpeg"]
    for f, start in zip(files, offsets[:-1].tolist()):
        jpeg[start : start + f.size] = f
    del tensors, jpeg
    return BatchDone(task.task_id, worker.worker_id, seg.name, seg.capacity, grown, layout, worker.timings(task),
                     tuple(skipped))
