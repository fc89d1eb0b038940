"""Decoding on the client (``decode_on_client=True``): the server sends JPEG files, the loader decodes.

A real server over real JPEG files (written with cv2.imencode: colour, grey, progressive, with an
EXIF orientation; and two photos cut from /usr/share/backgrounds when present). The OpenCV path
(CPU, no torchvision here) must give exactly the server-decoded stream's bytes.
"""

from __future__ import annotations

import json
import pathlib
import shutil

import albumentations as A
import cv2
import grpc
import numpy as np
import pytest
import torch

from batchd import RemoteDataLoader
from batchd.errors import SampleError
from batchd.server.data.decode import ImageReadError
from batchd.server.compute.encoded import check_jpeg
from batchd.client.device import decode
from batchd.v1 import loader_pb2 as pb
from batchd.v1 import loader_pb2_grpc
from helpers import jpeg_bytes as _jpeg, picture as _picture

pytestmark = pytest.mark.timeout(180)

PHOTOS = pathlib.Path("/usr/share/backgrounds/mate/nature")
FMNIST = pathlib.Path("/usr/share/datasets/fashion-mnist")


@pytest.fixture(scope="module")
def roots(tmp_path_factory) -> dict[str, pathlib.Path]:
    """same: 10 JPEGs of 48x64 (2 grey, 2 progressive, one EXIF-rotated 180 degrees); mixed: sizes
    from 37x51 to 120x160 (and 2 large photos if installed), one rotated 90 degrees (EXIF 6);
    bad: 5 JPEGs and a PNG (b/3.png)."""
    rng = np.random.default_rng(0)
    base = tmp_path_factory.mktemp("jpegs")
    out = {}
    for name in ("same", "mixed", "bad"):
        out[name] = base / name
    for i in range(10):
        p = out["same"] / ("a" if i % 2 else "b") / f"{i}.jpg"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(_jpeg(_picture(rng, 48, 64), grey=i in (1, 4), progressive=i in (2, 7),
                            orientation=3 if i == 5 else 0))
    sizes = [(37, 51), (120, 160), (64, 48), (90, 90), (33, 200), (101, 77), (48, 64), (150, 100)]
    for i, (h, w) in enumerate(sizes):
        p = out["mixed"] / ("a" if i % 2 else "b") / f"{i}.jpg"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(_jpeg(_picture(rng, h, w), progressive=i == 3, grey=i == 5, orientation=6 if i == 1 else 0))
    if PHOTOS.is_dir():
        (out["mixed"] / "c").mkdir()
        for k, photo in enumerate(sorted(PHOTOS.glob("*.jpg"))[:2]):
            shutil.copyfile(photo, out["mixed"] / "c" / f"photo{k}.jpg")
    for i in range(6):
        p = out["bad"] / "b" / f"{i}.{'png' if i == 3 else 'jpg'}"
        p.parent.mkdir(parents=True, exist_ok=True)
        rgb = _picture(rng, 40, 40)
        if i == 3:
            assert cv2.imwrite(str(p), cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR))
        else:
            p.write_bytes(_jpeg(rgb))
    return out


@pytest.fixture(scope="module")
def server(roots, tmp_path_factory):
    from conftest import running_server

    files = {"kind": "imagefolder", "reduced_decode": False}
    datasets = {
        "same": {**files, "root": str(roots["same"])},
        "mixed": {**files, "root": str(roots["mixed"])},
        "mixed-reduced": {"kind": "imagefolder", "root": str(roots["mixed"])},  # reduced_decode on (default)
        "bad": {**files, "root": str(roots["bad"])},
        "bad-skip": {**files, "root": str(roots["bad"]), "on_error": "skip", "max_skipped_fraction": 0.5},
    }
    if (FMNIST / "t10k-images-idx3-ubyte.gz").exists():
        datasets["fmnist"] = {"kind": "fashion-mnist", "root": str(FMNIST), "split": "test"}
    with running_server(cache_dir=tmp_path_factory.mktemp("idx"), datasets=datasets, workers=2) as s:
        yield s


def _batches(server, dataset: str, **kw) -> list[dict[str, torch.Tensor]]:
    kw.setdefault("batch_size", 3)
    with RemoteDataLoader(server.address, dataset, shuffle=True, seed=11, **kw) as loader:
        loader.set_epoch(2)
        return [{k: v.clone() for k, v in b.items()} for b in loader]


def _assert_same(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b) and a
    for x, y in zip(a, b):
        assert sorted(x) == sorted(y)
        for name in x:
            assert x[name].dtype == y[name].dtype and x[name].shape == y[name].shape, name
            assert torch.equal(x[name], y[name]), name


@pytest.mark.parametrize("transport", ["shm", "inline"])
@pytest.mark.parametrize("dataset, transform", [("same", None), ("mixed", A.Resize(56, 72)),
                                                ("mixed-reduced", A.Resize(28, 30)),
                                                ("same", A.Compose([A.Resize(96, 80)]))])
def test_client_decode_equals_the_server_decoded_stream(server, transport, dataset, transform):
    served = _batches(server, dataset, transform=transform, transport=transport)
    decoded_here = _batches(server, dataset, transform=transform, transport=transport, decode_on_client=True)
    _assert_same(decoded_here, served)
    assert decoded_here[0]["image"].dtype == torch.uint8 and decoded_here[0]["image"].shape[-1] == 3
    if transform is not None:
        resize = transform.transforms[0] if isinstance(transform, A.Compose) else transform
        assert decoded_here[0]["image"].shape[1:3] == (resize.height, resize.width)


def test_the_gpu_transform_hook_runs_on_client_decoded_batches(server):
    def finish(images, positions, *, seed, epoch):
        return images.flip(2).float() + positions.view(-1, 1, 1, 1) + epoch

    served = _batches(server, "same", gpu_transform=finish)
    decoded_here = _batches(server, "same", gpu_transform=finish, decode_on_client=True)
    _assert_same(decoded_here, served)
    assert decoded_here[0]["image"].dtype == torch.float32


@pytest.mark.parametrize("transform, named", [
    (A.HorizontalFlip(p=0.5), "HorizontalFlip"),
    (A.Compose([A.Resize(32, 32), A.RandomBrightnessContrast()]), "RandomBrightnessContrast"),
    (A.Resize(32, 32, interpolation=cv2.INTER_AREA), "interpolation=3"),
    (A.Resize(32, 32, p=0.5), "probability 0.5"),
])
def test_a_pipeline_the_client_cannot_redo_is_invalid_argument_naming_it(server, transform, named):
    with pytest.raises(ValueError, match=named) as info:
        _batches(server, "mixed", transform=transform, decode_on_client=True)
    assert "image_encoding JPEG" in str(info.value)
    with grpc.insecure_channel(server.address) as channel:
        stub = loader_pb2_grpc.BatchLoaderStub(channel)
        compose = transform if isinstance(transform, A.Compose) else A.Compose([transform])
        request = pb.StreamBatchesRequest(dataset="mixed", batch_size=2, image_encoding=pb.IMAGE_ENCODING_JPEG,
                                          pipeline=pb.Pipeline(albumentations_json=json.dumps(A.to_dict(compose))))
        with pytest.raises(grpc.RpcError) as rpc:
            next(iter(stub.StreamBatches(request, timeout=60)))
    assert rpc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and named in rpc.value.details()


def test_a_dataset_without_files_is_refused(server):
    if "fmnist" not in server.loader.datasets:
        pytest.skip("Fashion-MNIST is not installed")
    with pytest.raises(ValueError, match="holds decoded pixels"):
        _batches(server, "fmnist", decode_on_client=True)


def test_unknown_image_encoding_is_invalid_argument(server):
    with grpc.insecure_channel(server.address) as channel:
        stub = loader_pb2_grpc.BatchLoaderStub(channel)
        request = pb.StreamBatchesRequest(dataset="same", batch_size=2, image_encoding=7)
        with pytest.raises(grpc.RpcError) as rpc:
            next(iter(stub.StreamBatches(request, timeout=60)))
    assert rpc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "image_encoding: unknown value 7" in rpc.value.details()


def test_a_png_sample_is_a_sample_error_naming_the_file(server):
    assert len(_batches(server, "bad", batch_size=6)) == 1  # decoded on the server, the PNG is fine
    with pytest.raises(SampleError) as info:
        _batches(server, "bad", batch_size=6, decode_on_client=True)
    assert info.value.dataset == "bad" and info.value.path == "b/3.png" and info.value.index == 3
    assert "a PNG file, not a JPEG" in info.value.reason


def test_a_png_sample_is_skipped_with_on_error_skip(server):
    served = {int(i): img for b in _batches(server, "bad-skip", batch_size=6)
              for i, img in zip(b["index"], b["image"])}
    (batch,) = _batches(server, "bad-skip", batch_size=6, decode_on_client=True)
    assert batch["skipped"].tolist() == [3]
    assert sorted(batch["index"].tolist()) == [0, 1, 2, 4, 5] and batch["image"].shape == (5, 40, 40, 3)
    assert batch["label"].shape == batch["position"].shape == (5,)
    for i, img in zip(batch["index"].tolist(), batch["image"]):
        assert torch.equal(img, served[i])


def _stream(server, encoding) -> list[pb.Batch]:
    with grpc.insecure_channel(server.address) as channel:
        stub = loader_pb2_grpc.BatchLoaderStub(channel)
        return list(stub.StreamBatches(pb.StreamBatchesRequest(dataset="same", batch_size=4, image_encoding=encoding),
                                       timeout=60))


def test_a_jpeg_batch_carries_the_files_bytes_and_is_smaller_than_decoded(server):
    ds = server.loader.datasets["same"]
    jpeg, decoded = _stream(server, pb.IMAGE_ENCODING_JPEG), _stream(server, pb.IMAGE_ENCODING_DECODED)
    assert len(jpeg) == len(decoded) == 3
    for j, d in zip(jpeg, decoded):
        t = {x.name: x for x in j.tensors}
        assert set(t) == {"label", "index", "position", "jpeg", "jpeg_offsets", "jpeg_resize", "jpeg_reduce"}
        assert "image" not in t and j.tensors[0].name == "label"  # tensors[0] gives the batch size
        index = np.frombuffer(t["index"].data, np.int64)
        files = [bytes(ds.read_bytes(int(i))) for i in index]
        assert t["jpeg"].data == b"".join(files) and list(t["jpeg"].shape) == [sum(map(len, files))]
        assert np.frombuffer(t["jpeg_offsets"].data, np.int64).tolist() == np.cumsum([0, *map(len, files)]).tolist()
        assert np.frombuffer(t["jpeg_resize"].data, np.int64).tolist() == [0, 0]
        assert np.frombuffer(t["jpeg_reduce"].data, np.int64).tolist() == [1] * len(index)
        decoded_bytes = {x.name: x for x in d.tensors}["image"].data
        assert len(decoded_bytes) == len(index) * 48 * 64 * 3
        assert j.ByteSize() < len(decoded_bytes) / 2 < d.ByteSize()
        # the files plus a few small tensors (and the batch's timings, BatchTimings)
        assert j.ByteSize() - j.timings.ByteSize() < sum(map(len, files)) + 400


# --- the server's check of the bytes, and the client's pieces the GPU path uses ----------------------

def _sample_jpeg() -> bytes:
    return _jpeg(_picture(np.random.default_rng(1), 16, 24))


def _patch_sof(data: bytes, offset: int, value: bytes) -> bytes:
    sof = data.index(b"\xff\xc0")
    return data[: sof + offset] + value + data[sof + offset + len(value):]


@pytest.mark.parametrize("mutate, reason", [
    (lambda d: b"", "empty file"),
    (lambda d: cv2.imencode(".png", np.zeros((4, 4, 3), np.uint8))[1].tobytes(), "a PNG file, not a JPEG"),
    (lambda d: b"GIF89a" + d[6:], "a GIF file, not a JPEG"),
    (lambda d: d[:-200], "truncated JPEG"),
    (lambda d: _patch_sof(d, 1, b"\xc3"), "SOF3 (lossless)"),
    (lambda d: _patch_sof(d, 1, b"\xc9"), "SOF9 (arithmetic-coded sequential)"),
    (lambda d: _patch_sof(d, 4, b"\x0c"), "12-bit JPEG"),
    (lambda d: _patch_sof(d, 9, b"\x04"), "4 components"),
])
def test_check_jpeg_names_what_the_client_could_not_decode(mutate, reason):
    with pytest.raises(ImageReadError, match=reason.replace("(", r"\(").replace(")", r"\)")):
        check_jpeg(mutate(_sample_jpeg()))


def test_check_jpeg_accepts_baseline_progressive_grey_and_limits_pixels():
    rgb = _picture(np.random.default_rng(2), 20, 30)
    for data in (_jpeg(rgb), _jpeg(rgb, progressive=True), _jpeg(rgb, grey=True), _jpeg(rgb, orientation=6)):
        buf, size = check_jpeg(data)
        assert buf.tobytes() == data and size == (30, 20)
    with pytest.raises(ImageReadError, match="image too large: 30x20 = 600 pixels > max_pixels 599"):
        check_jpeg(_jpeg(rgb), max_pixels=599)


@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientation_is_applied_as_opencv_does(orientation):
    data = _jpeg(_picture(np.random.default_rng(3), 24, 40), orientation=orientation)
    assert decode.exif_orientation(np.frombuffer(data, np.uint8)) == orientation
    raw = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR | cv2.IMREAD_IGNORE_ORIENTATION)
    shown = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
    oriented = decode.orient(torch.from_numpy(raw).permute(2, 0, 1), orientation).permute(1, 2, 0)
    assert torch.equal(oriented, torch.from_numpy(shown))


def test_bilinear_resize_is_within_one_of_opencv_inter_linear():
    rgb = _picture(np.random.default_rng(4), 90, 130)
    for size in ((45, 65), (56, 72), (200, 150)):
        ours = decode.resize_bilinear(torch.from_numpy(rgb).permute(2, 0, 1), size).permute(1, 2, 0).numpy()
        theirs = cv2.resize(rgb, (size[1], size[0]), interpolation=cv2.INTER_LINEAR)
        assert ours.shape == theirs.shape
        assert np.abs(ours.astype(int) - theirs.astype(int)).max() <= 1
    same = torch.zeros(3, 5, 7, dtype=torch.uint8)
    assert decode.resize_bilinear(same, (5, 7)) is same


def test_decode_on_client_must_be_a_bool(server):
    with pytest.raises(ValueError, match="decode_on_client must be True or False"):
        RemoteDataLoader(server.address, "same", decode_on_client="yes")


def test_decoded_and_jpeg_streams_of_the_same_batches_do_not_share_a_computation(server):
    with grpc.insecure_channel(server.address) as channel:
        stub = loader_pb2_grpc.BatchLoaderStub(channel)
        request = pb.StreamBatchesRequest(dataset="same", batch_size=2, shuffle=True, seed=5, prefetch=1)
        decoded = stub.StreamBatches(request, timeout=60)
        first = next(iter(decoded))  # the decoded stream's computation is running (and shareable)
        request.image_encoding = pb.IMAGE_ENCODING_JPEG
        jpeg = stub.StreamBatches(request, timeout=60)
        names = [{t.name for t in b.tensors} for b in jpeg]
        decoded.cancel()
    assert "image" in {t.name for t in first.tensors}
    assert len(names) == 5 and all("jpeg" in n and "image" not in n for n in names)


def test_from_proto_keeps_the_image_encoding():
    from batchd.server.compute.protocol import StreamRequest

    jpeg = StreamRequest.from_proto(pb.StreamBatchesRequest(dataset="d", image_encoding=pb.IMAGE_ENCODING_JPEG))
    plain = StreamRequest.from_proto(pb.StreamBatchesRequest(dataset="d"))
    assert (jpeg.image_encoding, plain.image_encoding) == ("jpeg", "decoded")
    assert jpeg.key != plain.key


def test_the_gpu_path_around_nvjpeg_matches_opencv_with_a_stand_in_decoder(monkeypatch, roots):
    """decode_gpu's own work (split, EXIF orientation, resize, stack, layout) on the CPU, with OpenCV
    standing in for nvJPEG (which cannot run here) and, like it, ignoring the EXIF orientation."""
    def stand_in(files, mode, device):
        flags = cv2.IMREAD_COLOR | cv2.IMREAD_IGNORE_ORIENTATION
        return [torch.from_numpy(cv2.cvtColor(cv2.imdecode(f.numpy(), flags), cv2.COLOR_BGR2RGB)).permute(2, 0, 1)
                .to(device) for f in files]

    monkeypatch.setattr(decode, "_torchvision_decoder", lambda: (stand_in, "RGB"))
    for dataset, resize in (("same", (0, 0)), ("mixed", (56, 72))):
        files = [p.read_bytes() for p in sorted(roots[dataset].rglob("*.jpg"))]
        batch = {"index": torch.arange(len(files)), "jpeg_resize": torch.tensor(resize),
                 "jpeg_offsets": torch.tensor(np.cumsum([0, *map(len, files)])),
                 "jpeg": torch.from_numpy(np.frombuffer(b"".join(files), np.uint8).copy())}
        ours, opencv = decode.decode_gpu(batch, torch.device("cpu")).image, decode.decode_cpu(batch).image
        assert ours.shape == opencv.shape and ours.is_contiguous()
        if resize == (0, 0):
            assert torch.equal(ours, opencv)  # orientation 3 (one file) applied as OpenCV does
        else:
            assert (ours.int() - opencv.int()).abs().max() <= 1


def test_jpeg_reduce_says_how_the_server_would_have_decoded(server):
    """reduced_decode on: a JPEG at least twice the Resize in both dimensions is decoded at 1/2, 1/4, 1/8."""
    with grpc.insecure_channel(server.address) as channel:
        stub = loader_pb2_grpc.BatchLoaderStub(channel)
        pipeline = pb.Pipeline(albumentations_json=json.dumps(A.to_dict(A.Compose([A.Resize(28, 30)]))))
        reduce = {}
        for dataset in ("mixed-reduced", "mixed"):
            request = pb.StreamBatchesRequest(dataset=dataset, batch_size=16, pipeline=pipeline,
                                              image_encoding=pb.IMAGE_ENCODING_JPEG)
            (batch,) = stub.StreamBatches(request, timeout=60)
            t = {x.name: np.frombuffer(x.data, np.int64) for x in batch.tensors if x.dtype == "int64"}
            reduce[dataset] = dict(zip(t["index"].tolist(), t["jpeg_reduce"].tolist()))
    ds = server.loader.datasets["mixed"]
    sizes = {i: cv2.imread(str(ds.path(i)), cv2.IMREAD_IGNORE_ORIENTATION | cv2.IMREAD_COLOR).shape[:2]
             for i in reduce["mixed"]}
    expected = {i: max([1] + [n for n in (2, 4, 8) if -(-h // n) >= 28 and -(-w // n) >= 30])
                for i, (h, w) in sizes.items()}
    assert reduce["mixed-reduced"] == expected and len(set(expected.values())) >= 3
    assert set(reduce["mixed"].values()) == {1}  # reduced_decode off
