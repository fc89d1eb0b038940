"""Asking a server what it serves: ``list_datasets`` and ``describe_dataset``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np

from batchd.client.transport.channel import one_off, translate
from batchd.v1 import loader_pb2 as pb
from batchd.v1 import loader_pb2_grpc


@dataclass(frozen=True, slots=True)
class DatasetInfo:
    """A dataset on a server.

    sample_shape: one decoded image [H, W, C] before any pipeline; -1 where it varies.
    classes: label ``l`` is ``classes[l]``.
    fingerprint: what the samples are (imagefolder: its file list with sizes and mtimes;
        manifest: the table's content; fashion-mnist: its files' content), 32 hex characters.
    build_fingerprint: a hash of ``build``, what turns samples into pixels on that server:
        part -> text (``opencv``, ``albumentations``, ``numpy``, ``batchd`` versions, codec
        libraries, ``cv2_threads``, ``reduced_decode``). Equal fingerprints and builds: the same
        bytes for the same request. "" / {} from a server that does not report them.
    on_error: the dataset's ``on_error``, "raise" or "skip" (a sample that cannot be read fails
        the stream, or is left out and named in the batch's ``skipped``); the loader decoding JPEG
        batches itself (``decode_on_client``) does the same. "raise" from an older server.
    server_id: the server process that described it (random per process: a restart gets a new
        one); "" from an older server. Not part of ``identity``.
    weights_digest: the weights the server's config gives the dataset (for
        ``WeightedRandomSampler("dataset", ...)``), by digest; "" when it has none.
    class_counts: samples per class (label l: ``class_counts[l]``) where the server holds every
        label in an index (fashion-mnist, imagefolder, manifest, webdataset); () otherwise.
    labels: every sample's label, int64 [num_samples], when described with ``labels=True`` (the
        same kinds as class_counts), else None: for class balancing (docs/sampling.md).
    sources: a mix's (``batchd.Mix``) description of each source, in order; () for one dataset.
    """

    name: str
    kind: str
    num_samples: int
    classes: tuple[str, ...]
    sample_shape: tuple[int, ...]
    sample_dtype: str
    fingerprint: str = ""
    build_fingerprint: str = ""
    build: Mapping[str, str] = field(default_factory=dict, hash=False)
    on_error: str = "raise"
    server_id: str = ""
    weights_digest: str = ""
    class_counts: tuple[int, ...] = ()
    labels: np.ndarray | None = field(default=None, compare=False, hash=False, repr=False)
    sources: tuple["DatasetInfo", ...] = ()

    @classmethod
    def from_proto(cls, m: pb.DatasetInfo) -> "DatasetInfo":
        image = next((t for t in m.sample if t.name == "image"), pb.TensorSpec(dtype="uint8"))
        labels = np.frombuffer(m.labels, "<i8").astype(np.int64) if m.labels else None
        return cls(m.name, m.kind, m.num_samples, tuple(m.class_names), tuple(image.shape), image.dtype,
                   m.fingerprint, m.build_fingerprint, dict(m.build), m.on_error or "raise", m.server_id,
                   m.weights_digest, tuple(m.class_counts), labels)

    def identity(self) -> dict[str, Any]:
        """``{"fingerprint", "build_fingerprint", "build"}``: what ``mismatches`` compares (JSON-able)."""
        return {"fingerprint": self.fingerprint, "build_fingerprint": self.build_fingerprint, "build": dict(self.build)}


_BYTES_NEUTRAL = ("cache", "cache_prefix_rules")  # the server's build parts that never change bytes


def mismatches(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[str]:
    """What differs between two ``DatasetInfo.identity()`` dicts, in words (empty: nothing known).

    e.g. ``["dataset fingerprint 3f2a... vs 9c41...", "opencv 4.10.0 vs 5.0.0", "reduced_decode on
    vs off"]``. A value missing or empty on either side (an older server or state_dict) is not
    compared.
    """
    found = []
    fa, fb = a.get("fingerprint") or "", b.get("fingerprint") or ""  # (build parts that never change bytes,
    # the cache's, are left out of the build fingerprint by the server: not compared)
    if fa and fb and fa != fb:
        found.append(f"dataset fingerprint {fa} vs {fb}")
    ba, bb = a.get("build_fingerprint") or "", b.get("build_fingerprint") or ""
    if ba and bb and ba != bb:
        parts_a, parts_b = dict(a.get("build") or {}), dict(b.get("build") or {})
        named = [f"{k} {parts_a.get(k, '(none)')} vs {parts_b.get(k, '(none)')}"
                 for k in sorted(parts_a.keys() | parts_b.keys())
                 if parts_a.get(k) != parts_b.get(k) and k not in _BYTES_NEUTRAL]
        found.extend(named or [f"build fingerprint {ba} vs {bb}"])
    return found


def describe(channel: grpc.Channel, address: str, name: str, timeout: float, labels: bool = False) -> DatasetInfo:
    """Raises DatasetNotFoundError, ConnectionError or TimeoutError."""
    stub = loader_pb2_grpc.BatchLoaderStub(channel)
    try:
        return DatasetInfo.from_proto(stub.DescribeDataset(pb.DescribeDatasetRequest(name=name, labels=labels),
                                                           timeout=timeout))
    except grpc.RpcError as e:
        raise translate(e, address) from None


def list_datasets(address: str, *, timeout: float = 10.0, tls=None, tls_ca=None, tls_cert=None, tls_key=None,
                  token: str | None = None) -> list[DatasetInfo]:
    """The datasets served at ``address`` (those the token may read), sorted by name.

    tls, tls_ca, tls_cert, tls_key, token: as for RemoteDataLoader.
    Raises ConnectionError if no server answers within ``timeout`` seconds, AuthenticationError
    without a valid token (for a server with auth).
    """
    with one_off(address, timeout, tls, tls_ca, tls_cert, tls_key, token) as channel:
        reply = loader_pb2_grpc.BatchLoaderStub(channel).ListDatasets(pb.ListDatasetsRequest(), timeout=timeout)
    return [DatasetInfo.from_proto(d) for d in reply.datasets]


def describe_dataset(address: str, name: str, *, timeout: float = 10.0, labels: bool = False, tls=None, tls_ca=None,
                     tls_cert=None, tls_key=None, token: str | None = None) -> DatasetInfo:
    """One dataset at ``address``. labels: also every sample's label (``DatasetInfo.labels``, int64
    [num_samples]; 8 bytes a sample, so for a class-balancing recipe rather than every call).
    Raises DatasetNotFoundError, ConnectionError, or (with auth) AuthenticationError /
    PermissionDeniedError. TLS and token arguments as for RemoteDataLoader."""
    with one_off(address, timeout, tls, tls_ca, tls_cert, tls_key, token) as channel:
        return describe(channel, address, name, timeout, labels)
