"""Safe on a network: TLS and mutual TLS, bearer tokens with per-dataset scopes, the allowlist for
client pipelines, limits, unix-socket permissions and error hygiene, against real servers.

Certificates (a CA, a server certificate for 127.0.0.1/localhost, a client certificate, and a
rogue CA with its own client certificate) are generated at test time with ``cryptography``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pathlib
import re
import stat
import sys
import time

import albumentations as A
import cv2
import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

import batchd
from batchd import cli
from batchd.client.transport.channel import TLS, make_channel
from batchd.client.transport.datasets import describe_dataset
from batchd.client.transport.server_stats import get_stats
from batchd.server.compute import allowlist
from batchd.server.compute import pipeline as pipelines
from batchd.server.config import ConfigError, PipelineLimits, ServerConfig, load_config
from batchd.v1 import loader_pb2 as pb
from batchd.v1 import loader_pb2_grpc

pytestmark = pytest.mark.timeout(180)

TOKEN_A = "team-a-token-0123456789abcdef"
TOKEN_ADMIN = "admin-token-fedcba9876543210"
SERVICE = "/batchd.v1.BatchLoader/"
METHODS = {  # name -> kind: unary, stream (server streaming), bidi (the request a stream of one message)
    "ListDatasets": "unary", "DescribeDataset": "unary", "StreamBatches": "stream", "Batches": "bidi",
    "OpenSession": "stream", "ReleaseLeases": "unary", "Stats": "unary",
}


def _streaming_call(channel, method: str, payload: bytes, **kw):
    """A server-streaming or bidi call of ``method`` with ``payload`` as its (one) serialized request."""
    if METHODS[method] == "bidi":
        return channel.stream_stream(SERVICE + method, request_serializer=None, response_deserializer=None)(
            iter([payload]), **kw)
    return channel.unary_stream(SERVICE + method, request_serializer=None, response_deserializer=None)(payload, **kw)


# --- fixtures -----------------------------------------------------------------------------------


def _write_images(root: pathlib.Path, classes: int = 2, per_class: int = 8, size: int = 16) -> pathlib.Path:
    rng = np.random.default_rng(0)
    for c in range(classes):
        folder = root / f"class_{c}"
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            cv2.imwrite(str(folder / f"img_{i:03d}.png"), rng.integers(0, 256, (size, size, 3), dtype=np.uint8))
    return root


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> pathlib.Path:
    """Two image folders: tiny-a (16 images) and tiny-b (8 images), 16x16 PNG."""
    base = tmp_path_factory.mktemp("security-data")
    _write_images(base / "a", classes=2, per_class=8)
    _write_images(base / "b", classes=2, per_class=4)
    return base


def _datasets(data: pathlib.Path) -> dict:
    return {"tiny-a": {"kind": "imagefolder", "root": str(data / "a")},
            "tiny-b": {"kind": "imagefolder", "root": str(data / "b")}}


def _auth() -> dict:
    return {"tokens": [
        {"name": "team-a", "token_env": "BATCHD_TEST_TOKEN_A", "datasets": ["tiny-a"]},
        {"name": "admin", "token": TOKEN_ADMIN, "datasets": ["*"]},
    ]}


def _tls(pki, **extra) -> dict:
    return {"cert": str(pki["server_cert"]), "key": str(pki["server_key"]), **extra}


@pytest.fixture
def auth_server(make_server, data, monkeypatch):
    monkeypatch.setenv("BATCHD_TEST_TOKEN_A", TOKEN_A)
    monkeypatch.delenv("BATCHD_TOKEN", raising=False)
    return make_server(datasets=_datasets(data), auth=_auth(), workers=1)


def _raw_call(address, method, payload: bytes, *, metadata=(), timeout=5.0, tls=None):
    """Call ``method`` with ``payload`` as the serialized request; (code, details, responses)."""
    with make_channel(address, tls=tls) as channel:
        if METHODS[method] != "unary":
            it = _streaming_call(channel, method, payload, metadata=metadata, timeout=timeout)
            got = []
            try:
                for msg in it:
                    got.append(msg)
                    if len(got) >= 2:
                        it.cancel()
                        break
            except grpc.RpcError as e:
                return e.code(), e.details() or "", got
            return grpc.StatusCode.OK, "", got
        call = channel.unary_unary(SERVICE + method, request_serializer=None, response_deserializer=None)
        try:
            return grpc.StatusCode.OK, "", [call(payload, metadata=metadata, timeout=timeout)]
        except grpc.RpcError as e:
            return e.code(), e.details() or "", []


def _bearer(token):
    return (("authorization", f"Bearer {token}"),)


def _first_batch(address, dataset="tiny-a", **kw):
    with batchd.RemoteDataLoader(address, dataset, batch_size=4, transport="inline", reconnect_timeout=0,
                                 connect_timeout=5, **kw) as loader:
        return next(iter(loader))


# --- TLS ----------------------------------------------------------------------------------------


def test_tls_handshake_with_the_ca(make_server, data, pki, capsys):
    server = make_server(datasets=_datasets(data), tls=_tls(pki), workers=1)
    names = [d.name for d in batchd.list_datasets(server.address, tls_ca=str(pki["ca"]))]
    assert names == ["tiny-a", "tiny-b"]
    batch = _first_batch(server.address, tls_ca=str(pki["ca"]))
    assert batch["image"].shape == (4, 16, 16, 3)
    # the same through one TLS object, and by hostname (the certificate names localhost)
    port = server.address.rpartition(":")[2]
    names = [d.name for d in batchd.list_datasets(f"localhost:{port}", tls=TLS(ca=pki["ca"]))]
    assert names == ["tiny-a", "tiny-b"]
    assert get_stats(server.address, tls={"ca": str(pki["ca"])}).version
    assert cli.main(["health", server.address, "--tls-ca", str(pki["ca"])]) == 0
    assert cli.main(["status", server.address, "--tls-ca", str(pki["ca"]), "--json"]) == 0
    assert "SERVING" in capsys.readouterr().out


def test_plaintext_or_unknown_ca_against_a_tls_server_fails(make_server, data, pki):
    server = make_server(datasets=_datasets(data), tls=_tls(pki), workers=1)
    with pytest.raises(ConnectionError, match="TLS"):
        batchd.list_datasets(server.address, timeout=2)
    with pytest.raises(ConnectionError):  # TLS, but the server's CA is not trusted (system roots)
        batchd.list_datasets(server.address, timeout=2, tls=True)
    with pytest.raises(ConnectionError):
        batchd.RemoteDataLoader(server.address, "tiny-a", connect_timeout=2)
    assert cli.main(["health", server.address, "--timeout", "2"]) == 1


def test_mutual_tls_requires_a_client_certificate_from_the_ca(make_server, data, pki):
    server = make_server(datasets=_datasets(data), workers=1,
                         tls=_tls(pki, client_ca=str(pki["ca"]), require_client_cert=True))
    ca = str(pki["ca"])
    with pytest.raises(ConnectionError):  # no client certificate
        batchd.list_datasets(server.address, timeout=3, tls_ca=ca)
    with pytest.raises(ConnectionError):  # a certificate from another CA
        batchd.list_datasets(server.address, timeout=3, tls_ca=ca, tls_cert=str(pki["rogue_cert"]),
                             tls_key=str(pki["rogue_key"]))
    good = {"tls_ca": ca, "tls_cert": str(pki["client_cert"]), "tls_key": str(pki["client_key"])}
    assert [d.name for d in batchd.list_datasets(server.address, timeout=5, **good)] == ["tiny-a", "tiny-b"]
    assert _first_batch(server.address, **good)["label"].shape == (4,)
    with pytest.raises(ValueError, match="both tls_cert and tls_key"):
        batchd.list_datasets(server.address, tls_ca=ca, tls_cert=str(pki["client_cert"]))


def test_optional_client_certificates(make_server, data, pki):
    """client_ca without require_client_cert: clients with and without a certificate get in."""
    server = make_server(datasets=_datasets(data), workers=1, tls=_tls(pki, client_ca=str(pki["ca"])))
    ca = str(pki["ca"])
    assert len(batchd.list_datasets(server.address, tls_ca=ca)) == 2
    assert len(batchd.list_datasets(server.address, tls_ca=ca, tls_cert=str(pki["client_cert"]),
                                    tls_key=str(pki["client_key"]))) == 2


def test_tls_config_errors(tmp_path, pki):
    base = f"datasets: {{}}\ntls: {{cert: {pki['server_cert']}, key: {pki['server_key']}"
    path = tmp_path / "c.yaml"
    path.write_text(base + ", require_client_cert: true}\n")
    with pytest.raises(ConfigError, match="client_ca"):
        load_config(path)
    path.write_text(f"datasets: {{}}\ntls: {{cert: {tmp_path / 'missing.pem'}, key: {pki['server_key']}}}\n")
    with pytest.raises(ConfigError, match=r"tls\.cert"):
        load_config(path)


# --- tokens -------------------------------------------------------------------------------------


def test_missing_or_wrong_token_is_unauthenticated(auth_server):
    address = auth_server.address
    for token in (None, "not-a-valid-token-at-all-xyz"):
        with pytest.raises(batchd.AuthenticationError) as e:
            batchd.list_datasets(address, token=token)
        assert isinstance(e.value, PermissionError)
        with pytest.raises(batchd.AuthenticationError, match="token"):
            batchd.RemoteDataLoader(address, "tiny-a", token=token)
        with pytest.raises(batchd.AuthenticationError):
            get_stats(address, token=token)
    # every method, before the request is parsed (garbage bytes too)
    for method in METHODS:
        code, details, _ = _raw_call(address, method, b"\xff\x00garbage")
        assert code == grpc.StatusCode.UNAUTHENTICATED, (method, code, details)
        code, _, _ = _raw_call(address, method, b"", metadata=_bearer("wrong-token-0123456789"))
        assert code == grpc.StatusCode.UNAUTHENTICATED, method
        code, _, _ = _raw_call(address, method, b"", metadata=(("authorization", "Basic " + TOKEN_ADMIN),))
        assert code == grpc.StatusCode.UNAUTHENTICATED, method


def test_token_scopes_datasets(auth_server, caplog):
    address = auth_server.address
    assert [d.name for d in batchd.list_datasets(address, token=TOKEN_A)] == ["tiny-a"]
    assert [d.name for d in batchd.list_datasets(address, token=TOKEN_ADMIN)] == ["tiny-a", "tiny-b"]
    assert _first_batch(address, token=TOKEN_A)["image"].shape == (4, 16, 16, 3)
    assert _first_batch(address, "tiny-b", token=TOKEN_ADMIN)["image"].shape == (4, 16, 16, 3)

    # another dataset: PERMISSION_DENIED, and the same message whether or not it exists
    messages = {}
    for name in ("tiny-b", "no-such-dataset"):
        with pytest.raises(batchd.PermissionDeniedError) as e:
            batchd.RemoteDataLoader(address, name, token=TOKEN_A)
        assert isinstance(e.value, PermissionError)
        messages[name] = str(e.value).replace(name, "NAME")
        with pytest.raises(batchd.PermissionDeniedError):
            describe_dataset(address, name, token=TOKEN_A)
        # StreamBatches and Batches themselves check too (not only DescribeDataset)
        request = pb.StreamBatchesRequest(dataset=name, batch_size=1)
        for method, payload in (("StreamBatches", request), ("Batches", pb.BatchesControl(open=request, grant=[0]))):
            code, details, got = _raw_call(address, method, payload.SerializeToString(), metadata=_bearer(TOKEN_A))
            assert code == grpc.StatusCode.PERMISSION_DENIED and not got, method
            assert details.replace(name, "NAME") == messages[name], method
    assert messages["tiny-b"] == messages["no-such-dataset"], messages
    # the admin token reads everything; an unknown name is then simply not found
    with pytest.raises(batchd.DatasetNotFoundError):
        batchd.RemoteDataLoader(address, "no-such-dataset", token=TOKEN_ADMIN)


def test_token_from_environment_and_stats_scope(auth_server, monkeypatch):
    address = auth_server.address
    monkeypatch.setenv("BATCHD_TOKEN", TOKEN_A)
    assert [d.name for d in batchd.list_datasets(address)] == ["tiny-a"]
    with batchd.RemoteDataLoader(address, "tiny-b", batch_size=1, token=TOKEN_ADMIN, transport="inline",
                                 prefetch=1) as loader:
        it = iter(loader)
        next(it)  # a stream on tiny-b stays open
        assert [s.dataset for s in get_stats(address, token=TOKEN_ADMIN).streams] == ["tiny-b"]
        assert list(get_stats(address).streams) == []  # team-a does not see tiny-b's stream
        del it


def test_health_needs_no_token(auth_server, capsys):
    with grpc.insecure_channel(auth_server.address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    assert cli.main(["health", auth_server.address]) == 0


def test_cli_status_with_a_token_file(auth_server, tmp_path, capsys, monkeypatch):
    assert cli.main(["status", auth_server.address]) == 1
    assert "token" in capsys.readouterr().err
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN_A + "\n")
    token_file.chmod(0o600)
    assert cli.main(["status", auth_server.address, "--token-file", str(token_file), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["version"]


def test_tokens_are_never_logged(make_server, data, monkeypatch, caplog):
    monkeypatch.setenv("BATCHD_TEST_TOKEN_A", TOKEN_A)
    with caplog.at_level(logging.DEBUG):
        server = make_server(datasets=_datasets(data), auth=_auth(), workers=1)
        batchd.list_datasets(server.address, token=TOKEN_A)
        with pytest.raises(batchd.AuthenticationError):
            batchd.list_datasets(server.address, token=TOKEN_ADMIN[::-1])
        with pytest.raises(batchd.PermissionDeniedError):
            batchd.RemoteDataLoader(server.address, "tiny-b", token=TOKEN_A)
    text = caplog.text
    assert "team-a" in text  # names are logged...
    for secret in (TOKEN_A, TOKEN_ADMIN, TOKEN_ADMIN[::-1]):
        assert secret not in text  # ...tokens never
    assert TOKEN_ADMIN not in repr(server.config) and TOKEN_A not in repr(server.config)


def test_auth_config_errors(tmp_path, monkeypatch):
    monkeypatch.delenv("BATCHD_MISSING_TOKEN", raising=False)
    path = tmp_path / "c.yaml"

    def error(auth: str) -> str:
        path.write_text("datasets:\n  d: {kind: imagefolder, root: /data}\nauth:\n" + auth)
        with pytest.raises(ConfigError) as e:
            load_config(path)
        return str(e.value)

    assert "BATCHD_MISSING_TOKEN" in error("  tokens: [{name: a, token_env: BATCHD_MISSING_TOKEN, datasets: [d]}]\n")
    msg = error("  tokens: [{name: a, token: short, datasets: [d]}]\n")
    assert "at least 16" in msg and "short" not in msg.replace("token: short", "")
    assert "nope" in error(f"  tokens: [{{name: a, token: {TOKEN_A}, datasets: [nope]}}]\n")
    msg = error(f"  tokens: [{{name: a, token: {TOKEN_A}, token_env: X, datasets: [d]}}]\n")
    assert "exactly one" in msg and TOKEN_A not in msg
    assert "unique" in error(f"  tokens: [{{name: a, token: {TOKEN_A}, datasets: [d]}}, "
                             f"{{name: a, token: {TOKEN_ADMIN}, datasets: [d]}}]\n")


def test_warns_when_listening_beyond_loopback_without_auth(make_server, data, caplog):
    with caplog.at_level(logging.WARNING, logger="batchd.server"):
        make_server(datasets=_datasets(data), workers=1)
    assert not any("without authentication" in r.message for r in caplog.records)
    with caplog.at_level(logging.WARNING, logger="batchd.server"):
        make_server(datasets=_datasets(data), workers=1, address="0.0.0.0:0")
    assert any("without authentication" in r.message for r in caplog.records)


# --- clients name datasets, never paths ---------------------------------------------------------


@contextlib.contextmanager
def _file_access_log():
    """Paths this process opens or lists while the block runs (a sys audit hook)."""
    seen: list[str] = []
    _AUDIT.append(seen)
    try:
        yield seen
    finally:
        _AUDIT.remove(seen)


_AUDIT: list[list[str]] = []


def _audit(event: str, args) -> None:
    if _AUDIT and event in ("open", "os.listdir", "os.scandir", "os.chdir", "shutil.copyfile", "os.remove"):
        for log_ in _AUDIT:
            log_.append(str(args[0]) if args else "")


sys.addaudithook(_audit)

PATH_NAMES = ["../etc", "/etc/passwd", "../../../../etc/shadow", "tiny-a/../tiny-b", "./tiny-a", "~root", "",
              "PROBE-MARKER/../x", "file:///etc/passwd", "\x00"]


def test_dataset_names_are_names_not_paths(make_server, data, monkeypatch):
    server = make_server(datasets=_datasets(data), workers=1, pipelines={"flip": A.to_dict(A.HorizontalFlip())})
    preset_file = data / "preset.json"
    preset_file.write_text(json.dumps(A.to_dict(A.Compose([A.HorizontalFlip()]))))
    names = PATH_NAMES + [str(data / "a"), str(data / "a" / "class_0")]
    with _file_access_log() as opened:
        for name in names:
            # the client refuses an empty name itself; the server is asked below all the same
            with pytest.raises(ValueError if name == "" else batchd.DatasetNotFoundError):
                batchd.RemoteDataLoader(server.address, name, connect_timeout=5)
            request = pb.StreamBatchesRequest(dataset=name, batch_size=1)
            code, _, _ = _raw_call(server.address, "StreamBatches", request.SerializeToString())
            assert code == grpc.StatusCode.NOT_FOUND, name
            code, _, _ = _raw_call(server.address, "Batches", pb.BatchesControl(open=request).SerializeToString())
            assert code == grpc.StatusCode.NOT_FOUND, name
        for preset in (str(preset_file), "../preset.json", "/etc/passwd"):
            with pytest.raises(ValueError, match="unknown pipeline preset"):
                _first_batch(server.address, transform=preset)
    leaked = [p for p in opened if "PROBE-MARKER" in p or p.startswith(("/etc", "~")) or "preset.json" in p
              or p.startswith(str(data / "a" / "class_0"))]
    assert not leaked, leaked


def test_with_auth_path_names_are_permission_denied(auth_server):
    for name in PATH_NAMES[:4]:
        with pytest.raises(batchd.PermissionDeniedError):
            batchd.RemoteDataLoader(auth_server.address, name, token=TOKEN_A)


def test_no_request_data_is_unpickled():
    """pickle appears only where a worker checks that its own exception survives the pipe."""
    root = pathlib.Path(__file__).resolve().parents[2]
    users = {}
    for folder in ("server", "client", "batchd"):
        for path in (root / folder).rglob("*.py"):
            text = path.read_text()
            hits = re.findall(r"pickle\.loads?\(|yaml\.load\(|yaml\.unsafe_load|marshal\.loads|\beval\(|\bexec\(",
                              text)
            if hits:
                users[str(path.relative_to(root))] = hits
    assert users == {"server/compute/inbox.py": ["pickle.loads("]}, users
    inbox = (root / "server" / "compute" / "inbox.py").read_text()  # (the worker's side of its pipe)
    assert "pickle.loads(pickle.dumps(exc))" in inbox  # its own exception, round-tripped


# --- client pipelines ---------------------------------------------------------------------------


def _send_pipeline(address, spec, **kw):
    """First batch with ``spec`` (a dict, or JSON text) as the request's albumentations pipeline."""
    text = spec if isinstance(spec, str) else json.dumps(spec)
    with batchd.RemoteDataLoader(address, "tiny-a", batch_size=2, transport="inline", reconnect_timeout=0,
                                 connect_timeout=5, **kw) as loader:
        loader.options.pipeline = pb.Pipeline(albumentations_json=text)
        return next(iter(loader))


def _compose(*transforms) -> dict:
    return {"__version__": "2.0.8", "transform": {"__class_fullname__": "Compose", "p": 1.0,
                                                  "transforms": list(transforms)}}


FILE_READERS = [
    ({"__class_fullname__": "HistogramMatching", "reference_images": ["/etc/passwd"], "blend_ratio": [0.5, 1.0],
      "p": 1.0}, "reference_images"),
    ({"__class_fullname__": "FDA", "reference_images": ["/etc/hostname"], "beta_limit": [0, 0.1], "p": 1.0},
     "reference_images"),
    ({"__class_fullname__": "PixelDistributionAdaptation", "reference_images": ["/etc/passwd"],
      "blend_ratio": [0.25, 1.0], "transform_type": "pca", "p": 1.0}, "reference_images"),
    ({"__class_fullname__": "TextImage", "font_path": "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
      "p": 1.0}, "font_path"),
    ({"__class_fullname__": "Lambda", "__name__": "steal", "p": 1.0}, "__name__"),
]

OVERSIZED = [
    ({"__class_fullname__": "Resize", "height": 100000, "width": 100000, "p": 1.0}, "Resize", "height"),
    ({"__class_fullname__": "Resize", "height": 64, "width": 5000, "p": 1.0}, "Resize", "width"),
    ({"__class_fullname__": "GaussianBlur", "blur_limit": [3, 100001], "p": 1.0}, "GaussianBlur", "blur_limit"),
    ({"__class_fullname__": "MedianBlur", "blur_limit": 999, "p": 1.0}, "MedianBlur", "blur_limit"),
    ({"__class_fullname__": "MotionBlur", "blur_limit": [3, 1001], "p": 1.0}, "MotionBlur", "blur_limit"),
    ({"__class_fullname__": "GaussianBlur", "sigma_limit": [1, 1e6], "p": 1.0}, "GaussianBlur", "sigma_limit"),
    ({"__class_fullname__": "ElasticTransform", "sigma": 5000.0, "p": 1.0}, "ElasticTransform", "sigma"),
    ({"__class_fullname__": "CLAHE", "tile_grid_size": [4096, 4096], "p": 1.0}, "CLAHE", "tile_grid_size"),
    ({"__class_fullname__": "RandomCrop", "height": 8, "width": 70000, "p": 1.0}, "RandomCrop", "width"),
    ({"__class_fullname__": "RandomResizedCrop", "size": [50000, 50000], "p": 1.0}, "RandomResizedCrop", "size"),
    ({"__class_fullname__": "PadIfNeeded", "min_height": 100000, "min_width": 8, "p": 1.0}, "PadIfNeeded",
     "min_height"),
    ({"__class_fullname__": "LongestMaxSize", "max_size": 65536, "p": 1.0}, "LongestMaxSize", "max_size"),
    ({"__class_fullname__": "SmallestMaxSize", "max_size": 65536, "p": 1.0}, "SmallestMaxSize", "max_size"),
    ({"__class_fullname__": "CoarseDropout", "num_holes_range": [1, 10 ** 7], "p": 1.0}, "CoarseDropout",
     "num_holes_range"),
    ({"__class_fullname__": "ToGray", "num_output_channels": 100000, "p": 1.0}, "ToGray", "num_output_channels"),
    ({"__class_fullname__": "Affine", "scale": 50.0, "fit_output": True, "p": 1.0}, "Affine", "fit_output"),
    ({"__class_fullname__": "Normalize", "normalization": "../../etc/passwd", "p": 1.0}, "Normalize",
     "normalization"),
    ({"__class_fullname__": "Resize", "height": 8, "width": 8, "interpolation": "/etc/passwd", "p": 1.0}, "Resize",
     "interpolation"),
    ({"__class_fullname__": "Resize", "height": 8, "width": 8, "read_fn": "x", "p": 1.0}, "Resize", "read_fn"),
    ({"__class_fullname__": "Compose", "transforms": [], "bbox_params": {"format": "coco"}, "p": 1.0}, "Compose",
     "bbox_params"),
]


@pytest.fixture
def pipeline_server(make_server, data):
    return make_server(datasets=_datasets(data), workers=1,
                       pipeline_limits={"max_pixels": 1_000_000, "max_side": 4096})


@pytest.mark.parametrize("transform,field", FILE_READERS, ids=[t["__class_fullname__"] for t, _ in FILE_READERS])
def test_file_reading_transforms_are_refused(pipeline_server, monkeypatch, transform, field):
    built = []
    monkeypatch.setattr(pipelines.A, "from_dict", lambda *a, **k: built.append(a) or pytest.fail("from_dict called"))
    with pytest.raises(ValueError) as e:
        _send_pipeline(pipeline_server.address, _compose(transform))
    msg = str(e.value)
    assert transform["__class_fullname__"] in msg and field in msg, msg
    assert "transform.transforms[0]" in msg, msg
    assert not built  # checked before albumentations saw it


@pytest.mark.parametrize("transform,name,field", OVERSIZED, ids=[f"{n}-{f}" for _, n, f in OVERSIZED])
def test_oversized_parameters_are_refused(pipeline_server, transform, name, field):
    with pytest.raises(ValueError) as e:
        _send_pipeline(pipeline_server.address, _compose(transform))
    msg = str(e.value)
    assert name in msg and field in msg, msg


def test_pipeline_shape_limits(pipeline_server):
    address = pipeline_server.address
    with pytest.raises(ValueError, match=r"Resize.*pixels.*max_pixels"):  # 2000 x 2000 > max_pixels=1e6
        _send_pipeline(address, _compose({"__class_fullname__": "Resize", "height": 2000, "width": 2000, "p": 1.0}))
    flip = {"__class_fullname__": "HorizontalFlip", "p": 0.5}
    with pytest.raises(ValueError, match="max_transforms"):
        _send_pipeline(address, _compose(*[flip] * 64))  # 64 + the Compose
    nested = flip
    for _ in range(4):
        nested = {"__class_fullname__": "OneOf", "p": 1.0, "transforms": [nested]}
    with pytest.raises(ValueError, match=r"OneOf.*transforms.*max_depth"):
        _send_pipeline(address, _compose(nested))
    with pytest.raises(ValueError, match="max_json_bytes"):
        _send_pipeline(address, _compose({**flip, "pad": "x" * 70_000}))
    with pytest.raises(ValueError, match="nested too deeply|max_json_bytes"):
        _send_pipeline(address, "[" * 20_000 + "]" * 20_000)
    with pytest.raises(ValueError, match="finite"):
        _send_pipeline(address, _compose({"__class_fullname__": "Rotate", "limit": float("inf"), "p": 1.0}))
    for name in ("os.system", "albumentations.core.serialization.from_dict", "ToTensorV2", "OneOrOther"):
        with pytest.raises(ValueError, match="__class_fullname__|not allowed"):
            _send_pipeline(address, _compose({"__class_fullname__": name, "p": 1.0}))
    with pytest.raises(ValueError, match="unknown top-level field"):
        _send_pipeline(address, {**_compose(flip), "extra": 1})


def test_allowed_pipelines_still_work(pipeline_server):
    good = A.Compose([A.Resize(24, 24), A.OneOf([A.HorizontalFlip(), A.VerticalFlip()]), A.RandomCrop(20, 20),
                      A.ColorJitter(), A.GaussianBlur(blur_limit=(3, 5)), A.CoarseDropout(fill="random"),
                      A.Normalize()])
    with batchd.RemoteDataLoader(pipeline_server.address, "tiny-a", batch_size=4, transform=good,
                                 transport="inline") as loader:
        batches = list(loader)
    assert len(batches) == 4 and batches[0]["image"].shape == (4, 20, 20, 3)
    assert batches[0]["image"].dtype.is_floating_point


def _default_instances():
    required = {"Resize": dict(height=8, width=8), "RandomCrop": dict(height=8, width=8),
                "CenterCrop": dict(height=8, width=8), "RandomResizedCrop": dict(size=(8, 8)),
                "RandomSizedCrop": dict(min_max_height=(4, 8), size=(8, 8)), "SmallestMaxSize": dict(max_size=8),
                "LongestMaxSize": dict(max_size=8), "RandomSizedBBoxSafeCrop": dict(height=8, width=8),
                "AtLeastOneBBoxRandomCrop": dict(height=8, width=8)}
    for name in sorted(allowlist.ALLOWED - allowlist.COMPOSITIONS):
        yield name, getattr(A, name)(**required.get(name, {}))


@pytest.mark.filterwarnings("ignore::UserWarning")  # albumentations on fields to_dict writes but ignores
def test_every_allowlisted_transform_serializes_through_the_check_and_reads_no_files():
    from albumentations.core.serialization import SERIALIZABLE_REGISTRY

    limits = PipelineLimits()
    image = np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    for name in allowlist.ALLOWED:
        assert name in SERIALIZABLE_REGISTRY, name
    # the box-safe crops read the sample's boxes (RandomCropNearBBox its cropping_bbox field)
    boxes = {"bboxes": np.array([[2, 2, 20, 20]], np.float32), "cropping_bbox": [2, 2, 20, 20]}
    for name, transform in _default_instances():
        with_boxes = "BBox" in name
        params = {"bbox_params": A.BboxParams(format="pascal_voc")} if with_boxes else {}
        data = {"image": image, **(boxes if with_boxes else {})}
        spec = json.loads(json.dumps(A.to_dict(A.Compose([transform], **params))))
        allowlist.check(spec, limits)  # what A.to_dict writes for it is accepted
        compose = pipelines.build(pipelines.canonical_json(spec))
        compose.set_random_seed(0)
        compose(**data)  # warm up (lazy imports)
        with _file_access_log() as opened:
            compose = pipelines.build(pipelines.canonical_json(spec))
            for seed in range(3):
                compose.set_random_seed(seed)
                compose(**data)
        assert not opened, (name, opened)
    for name in allowlist.DANGEROUS:
        assert name not in allowlist.ALLOWED


# --- limits -------------------------------------------------------------------------------------


def test_batch_size_and_prefetch_limits(make_server, data):
    server = make_server(datasets=_datasets(data), workers=1, max_batch_size=8, max_prefetch=2, default_prefetch=1)
    with pytest.raises(ValueError, match="batch_size"):
        with batchd.RemoteDataLoader(server.address, "tiny-a", batch_size=9, transport="inline") as loader:
            next(iter(loader))
    # max_prefetch bounds what a StreamBatches call (an older client) asks the server to build ahead ...
    with grpc.insecure_channel(server.address) as channel:
        request = pb.StreamBatchesRequest(dataset="tiny-a", batch_size=4, prefetch=3, transport=pb.TRANSPORT_INLINE)
        with pytest.raises(grpc.RpcError, match="prefetch"):
            list(loader_pb2_grpc.BatchLoaderStub(channel).StreamBatches(request, timeout=30))
    # ... a Batches call's client grants what it wants built (max_grants bounds it): prefetch is its own
    assert _first_batch(server.address, prefetch=3)["image"].shape[0] == 4


def test_concurrent_stream_limit(make_server, data):
    server = make_server(datasets=_datasets(data), workers=1, max_streams=2)
    big = A.Compose([A.Resize(256, 256)])  # 192 KiB images: a stream fills gRPC's window and stays open
    loaders, iterators = [], []
    try:
        for _ in range(2):
            loader = batchd.RemoteDataLoader(server.address, "tiny-a", batch_size=1, transform=big,
                                             transport="inline", prefetch=1, reconnect_timeout=0)
            loaders.append(loader)
            iterators.append(iter(loader))
            next(iterators[-1])
        assert len(server.loader.streams) == 2
        third = batchd.RemoteDataLoader(server.address, "tiny-a", batch_size=1, transport="inline",
                                        reconnect_timeout=0)
        loaders.append(third)
        with pytest.raises(batchd.ResourceExhaustedError, match="max_streams") as e:
            next(iter(third))
        assert isinstance(e.value, batchd.BatchdError)
        loaders[0].close()
        deadline = time.monotonic() + 10
        while len(server.loader.streams) > 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert next(iter(third))["image"].shape[0] == 1
    finally:
        iterators.clear()
        for loader in loaders:
            loader.close()


def test_batch_bytes_limit(make_server, data):
    server = make_server(datasets=_datasets(data), workers=1, max_batch_bytes=1 << 20)
    big = A.Compose([A.Resize(256, 256)])  # 8 x 256 x 256 x 3 = 1.5 MiB > 1 MiB
    with pytest.raises(batchd.ResourceExhaustedError, match="max_batch_bytes"):
        with batchd.RemoteDataLoader(server.address, "tiny-a", batch_size=8, transform=big,
                                     transport="inline") as loader:
            next(iter(loader))
    with batchd.RemoteDataLoader(server.address, "tiny-a", batch_size=4, transform=big,
                                 transport="inline") as loader:
        assert next(iter(loader))["image"].shape == (4, 256, 256, 3)  # 768 KiB fits


def test_request_size_limit(make_server, data):
    server = make_server(datasets=_datasets(data), workers=1, max_request_bytes=64 * 1024,
                         pipeline_limits={"max_json_bytes": 32 * 1024})
    huge = _compose({"__class_fullname__": "HorizontalFlip", "p": 0.5, "x": "y" * 100_000})
    with pytest.raises(batchd.ResourceExhaustedError):
        _send_pipeline(server.address, huge)
    assert _first_batch(server.address)["image"].shape[0] == 4


def test_a_huge_world_size_costs_nothing(make_server, data):
    """world_size up to 2**32 - 1: the shard is computed without materialising the padded order."""
    server = make_server(datasets=_datasets(data), workers=1)
    started = time.monotonic()
    for rank in (0, 2 ** 32 - 2):
        request = pb.StreamBatchesRequest(dataset="tiny-a", batch_size=4, world_size=2 ** 32 - 1, rank=rank)
        code, details, got = _raw_call(server.address, "StreamBatches", request.SerializeToString())
        assert code == grpc.StatusCode.OK and len(got) == 1, (code, details)
    assert time.monotonic() - started < 10


def test_client_maps_only_plain_segment_names():
    from batchd.client.transport import shm as client_shm

    for name in ("../../etc/passwd", "/etc/passwd", "", "..", "a\x00b"):
        with pytest.raises(client_shm.SharedMemoryUnavailable):
            client_shm._segment_path(name)
    assert os.path.basename(client_shm._segment_path("batchd-1-slot-3")) == "batchd-1-slot-3"


# --- unix sockets -------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", [None, 0o660])
def test_unix_socket_is_private(make_server, data, tmp_path, mode):
    path = tmp_path / "run" / "batchd" / "batchd.sock"  # the parent does not exist yet
    extra = {} if mode is None else {"unix_socket_mode": mode}
    server = make_server(datasets=_datasets(data), workers=1, address=f"unix:{path}", **extra)
    assert stat.S_ISSOCK(os.stat(path).st_mode)
    assert stat.S_IMODE(os.stat(path).st_mode) == (mode or 0o600)
    assert stat.S_IMODE(os.stat(path.parent).st_mode) & 0o077 == 0
    assert [d.name for d in batchd.list_datasets(server.address)] == ["tiny-a", "tiny-b"]


def test_unix_socket_stays_plaintext_on_a_tls_server(make_server, data, tmp_path, pki):
    path = tmp_path / "tls.sock"
    server = make_server(datasets=_datasets(data), workers=1, address=f"unix:{path}", tls=_tls(pki))
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert len(batchd.list_datasets(server.address)) == 2  # protected by the file mode, not TLS


def test_unix_socket_mode_for_others_is_refused():
    with pytest.raises(ValueError, match="others"):
        ServerConfig.model_validate({"unix_socket_mode": 0o666})
    assert ServerConfig.model_validate({"unix_socket_mode": "0660"}).unix_socket_mode == 0o660


# --- error hygiene ------------------------------------------------------------------------------


def test_unexpected_handler_error_is_internal_with_a_request_id(make_server, data, monkeypatch, caplog):
    server = make_server(datasets=_datasets(data), workers=1)
    secret = str(server.config.cache_dir / "secret.bin")

    def boom(*a, **k):
        raise RuntimeError(f"cannot open {secret}")

    monkeypatch.setattr("batchd.server.serve.service.dataset_info", boom)
    with caplog.at_level(logging.ERROR, logger="batchd.server.serve.service"):
        with pytest.raises(batchd.BatchdError) as e:
            batchd.list_datasets(server.address)
    msg = str(e.value)
    request_id = re.search(r"request id ([0-9a-f]{12})", msg)
    assert "internal error" in msg and request_id, msg
    assert secret not in msg and "Traceback" not in msg
    logged = caplog.text
    assert request_id.group(1) in logged and secret in logged and "Traceback" in logged


def test_worker_failures_reach_the_client_without_paths_or_tracebacks(make_server, data, tmp_path):
    cache = tmp_path / "cache"
    server = make_server(datasets=_datasets(data), workers=1, cache_dir=cache)
    for index in cache.glob("*.bidx"):  # the workers find no index: IndexMissingError naming the cache path
        index.unlink()
    with make_channel(server.address) as channel:
        call = channel.unary_stream(SERVICE + "StreamBatches", request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.RpcError) as e:
            list(call(pb.StreamBatchesRequest(dataset="tiny-a", batch_size=2).SerializeToString(), timeout=30))
    err = e.value
    texts = [err.details()]
    for key, value in err.trailing_metadata() or ():
        if key == "batchd-error-bin":
            detail = pb.ErrorDetail.FromString(value)
            texts += [detail.message, *detail.paths, detail.reason]
    assert err.code() == grpc.StatusCode.INTERNAL and "IndexMissingError" in texts[0], texts
    for text in texts:
        assert "Traceback" not in text and str(cache) not in text and str(cache.resolve()) not in text, text
        assert str(data) not in text, text
    assert "<server path>" in texts[0]


def test_bad_sample_error_names_the_relative_path_only(make_server, data, tmp_path):
    root = _write_images(tmp_path / "broken", classes=1, per_class=2)
    (root / "class_0" / "img_001.png").write_bytes(b"not a png")
    server = make_server(datasets={"broken": {"kind": "imagefolder", "root": str(root)}}, workers=1)
    with pytest.raises(batchd.SampleError) as e:
        with batchd.RemoteDataLoader(server.address, "broken", batch_size=2, transport="inline") as loader:
            next(iter(loader))
    assert e.value.path == "class_0/img_001.png"
    assert str(root) not in str(e.value)


# --- fuzzing ------------------------------------------------------------------------------------


def test_random_and_malformed_requests_leave_the_server_serving(make_server, data, monkeypatch):
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    monkeypatch.setenv("BATCHD_TEST_TOKEN_A", TOKEN_A)
    server = make_server(datasets=_datasets(data), auth=_auth(), workers=1, max_batch_size=16, max_prefetch=4,
                         max_streams=8, max_batch_bytes=1 << 20,
                         pipeline_limits={"max_side": 64, "max_pixels": 4096, "max_transforms": 8})
    address = server.address
    forbidden = [str(server.config.cache_dir), str(pathlib.Path(server.config.cache_dir).resolve()), str(data),
                 str(data.resolve())]
    channels = {"admin": make_channel(address, token=TOKEN_ADMIN), "team-a": make_channel(address, token=TOKEN_A),
                "none": make_channel(address)}
    seen_codes: dict[str, int] = {}
    started = time.monotonic()

    def check_message(text: str) -> None:
        assert "Traceback" not in text, text
        assert "internal error (see the server log" not in text, text  # no handler crashed
        for path in forbidden:
            assert path not in text, text

    def call(who: str, method: str, payload: bytes) -> None:
        channel = channels[who]
        if METHODS[method] != "unary":
            it = _streaming_call(channel, method, payload, timeout=3)
            try:
                for _ in it:  # one message is enough (an open session would stream nothing more)
                    seen_codes["OK"] = seen_codes.get("OK", 0) + 1
                    break
                it.cancel()
            except grpc.RpcError as e:
                _record(e)
        else:
            try:
                channel.unary_unary(SERVICE + method, request_serializer=None, response_deserializer=None)(
                    payload, timeout=3)
                seen_codes["OK"] = seen_codes.get("OK", 0) + 1
            except grpc.RpcError as e:
                _record(e)

    def _record(e: grpc.RpcError) -> None:
        seen_codes[e.code().name] = seen_codes.get(e.code().name, 0) + 1
        check_message(e.details() or "")
        for key, value in e.trailing_metadata() or ():
            if key == "batchd-error-bin":
                with contextlib.suppress(Exception):
                    d = pb.ErrorDetail.FromString(value)
                    for text in (d.message, d.reason, *d.paths):
                        check_message(text)

    names = sorted(allowlist.ALLOWED | set(allowlist.DANGEROUS) | {"Resize", "os.system", "", "Compose"})
    fields = ["p", "height", "width", "blur_limit", "transforms", "reference_images", "font_path", "size",
              "max_size", "interpolation", "fill", "normalization", "__name__", "mean", "std", "n", "x"]
    leaf = st.one_of(st.none(), st.booleans(), st.integers(-2 ** 70, 2 ** 70), st.floats(allow_nan=True),
                     st.text(max_size=20), st.sampled_from(["/etc/passwd", "../x", "center", "standard"]))
    values = st.recursive(leaf, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner,
                                                                                              max_size=3),
                          max_leaves=10)
    transform = st.recursive(
        st.fixed_dictionaries({"__class_fullname__": st.sampled_from(names)},
                              optional={f: values for f in fields}),
        lambda inner: st.fixed_dictionaries({"__class_fullname__": st.sampled_from(sorted(allowlist.COMPOSITIONS)),
                                             "transforms": st.lists(inner, max_size=3)},
                                            optional={"p": st.floats(0, 1)}),
        max_leaves=6)
    pipeline = st.one_of(
        st.builds(lambda t: json.dumps({"__version__": "2.0.8", "transform": t}), transform),
        st.text(max_size=50),
        st.sampled_from(["", "{}", "[]", "null", '{"transform": 1}', "[" * 5000 + "]" * 5000]),
    )
    u32, u64 = st.integers(0, 2 ** 32 - 1), st.integers(0, 2 ** 64 - 1)
    stream_request = st.builds(
        lambda ds, pipe, preset, bs, shuffle, seed, epoch, drop, rank, ws, start, prefetch, transport, session, comp:
        pb.StreamBatchesRequest(
            dataset=ds, batch_size=bs, shuffle=shuffle, seed=seed, epoch=epoch, drop_last=drop, rank=rank,
            world_size=ws, start_batch=start, prefetch=prefetch, transport=transport, session=session,
            compression=comp,
            pipeline=pb.Pipeline(preset=preset) if preset is not None else
            (pb.Pipeline(albumentations_json=pipe) if pipe is not None else None),
        ).SerializeToString(),
        st.just("tiny-a") | st.sampled_from(["tiny-b", "nope", "../etc", "/etc/passwd", ""]) | st.text(max_size=10),
        st.none() | pipeline, st.none() | st.text(max_size=10),
        st.integers(0, 40) | u32, st.booleans(), u64, st.integers(0, 3) | u64, st.booleans(),
        st.integers(0, 3) | u32, st.integers(0, 3) | u32, st.integers(0, 20) | u64, st.integers(0, 6) | u32,
        st.sampled_from([0, 1, 7]), st.text(max_size=40), st.sampled_from([0, 1, 9]),
    )
    other_requests = st.one_of(
        st.tuples(st.just("DescribeDataset"), st.builds(lambda n: pb.DescribeDatasetRequest(name=n).SerializeToString(),
                                                        st.text(max_size=30))),
        st.tuples(st.just("ReleaseLeases"), st.builds(
            lambda s, ls: pb.ReleaseLeasesRequest(session=s, leases=ls).SerializeToString(),
            st.text(max_size=40), st.lists(u64, max_size=10))),
        st.tuples(st.just("OpenSession"), st.builds(lambda s: pb.OpenSessionRequest(session=s).SerializeToString(),
                                                    st.text(max_size=40))),
        st.tuples(st.sampled_from(["ListDatasets", "Stats"]), st.just(b"")),
    )
    batches_control = st.builds(  # a Batches call's one message: open, and grants in or out of range
        lambda req, grants, revokes: pb.BatchesControl(open=pb.StreamBatchesRequest.FromString(req), grant=grants,
                                                       revoke=revokes).SerializeToString(),
        stream_request, st.lists(st.integers(0, 5) | u64, max_size=6), st.lists(u64, max_size=3))
    request = st.one_of(
        st.tuples(st.sampled_from(sorted(METHODS)), st.binary(max_size=300)),  # random bytes to every RPC
        st.tuples(st.just("StreamBatches"), stream_request),
        st.tuples(st.just("Batches"), batches_control),
        other_requests,
    )

    @settings(max_examples=100, deadline=None, database=None, derandomize=False,
              suppress_health_check=list(HealthCheck))
    @given(st.lists(st.tuples(st.sampled_from(["admin", "admin", "team-a", "none"]), request), min_size=1, max_size=3))
    def throw(requests):
        for who, (method, payload) in requests:
            call(who, method, payload)

    try:
        throw()
        # still serving: health, and a normal stream gives the right batches
        with grpc.insecure_channel(address) as health_channel:
            reply = health_pb2_grpc.HealthStub(health_channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with batchd.RemoteDataLoader(address, "tiny-a", batch_size=4, token=TOKEN_A, transport="inline") as loader:
            batches = list(loader)
        assert sorted(int(i) for b in batches for i in b["index"]) == list(range(16))
        deadline = time.monotonic() + 10
        while server.loader.streams and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not server.loader.streams, "streams of the fuzzed requests are still open"
    finally:
        for channel in channels.values():
            channel.close()
    elapsed = time.monotonic() - started
    assert elapsed < 120, f"the fuzz test took {elapsed:.0f} s"
    print(f"fuzz: {elapsed:.1f} s, error codes seen: {seen_codes}")
