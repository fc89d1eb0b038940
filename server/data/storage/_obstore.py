"""S3 through obstore (Rust's ``object_store``): the default backend for ``s3://`` datasets.

Measured against fsspec/s3fs on SeaweedFS (see /work/notes/readme-storage.md): about 1 ms and
0.3-0.5 ms of CPU per 110 KB object, against 12-14 ms and 3-6 ms of CPU through s3fs
(aiobotocore), so the worker's core stays on decoding. Retries are object_store's own:
exponential backoff with jitter on 5xx, throttling, connection errors, dropped connections and
timeouts of read-only requests, ``max_retries = max_attempts - 1``; ``timeout_s`` is the connect
timeout and the whole-request timeout.
"""

from __future__ import annotations

import io
import os
from datetime import timedelta
from typing import Any


class ObstoreS3:
    """Reads ``s3://bucket/key`` URLs with one ``S3Store`` per bucket (made on first use).

    Methods mirror ``Storage``'s: ``read``, ``info``, ``list_files``, ``download``; they raise
    FileNotFoundError (``no such object: URL``) and the ``errors`` callable's exception for
    anything else (after object_store's retries).
    """

    def __init__(self, options: dict[str, Any], *, max_attempts: int, timeout_s: float, fail):
        self._options = options
        self._max_attempts = max_attempts
        self._timeout_s = timeout_s
        self._fail = fail  # (what, url, exception) -> exception to raise
        self._stores: dict[str, Any] = {}

    def _client_options(self, allow_http: bool) -> dict[str, Any]:
        """object_store's ClientConfig: ``timeout_s`` to connect and for a whole request."""
        timeout = timedelta(seconds=self._timeout_s)
        return {"connect_timeout": timeout, "timeout": timeout, **({"allow_http": True} if allow_http else {})}

    def _retry_config(self) -> dict[str, Any]:
        """object_store's RetryConfig: ``max_attempts - 1`` retries, exponential backoff with jitter
        (200 ms initial, base 2, 15 s cap), all retries of a request within 4 x ``timeout_s`` (>= 60 s)."""
        return {"max_retries": self._max_attempts - 1, "retry_timeout": timedelta(seconds=max(60.0, 4 * self._timeout_s)),
                "backoff": {"init_backoff": timedelta(milliseconds=200), "max_backoff": timedelta(seconds=15), "base": 2}}

    def _store(self, bucket: str):
        store = self._stores.get(bucket)
        if store is None:
            from obstore.store import S3Store

            o = self._options
            kw: dict[str, Any] = {}
            if o.get("endpoint_url"):
                kw["endpoint"] = o["endpoint_url"]
            if o.get("key"):
                kw["access_key_id"] = o["key"]
            if o.get("secret"):
                kw["secret_access_key"] = o["secret"]
            if o.get("token"):
                kw["session_token"] = o["token"]
            kw["region"] = o.get("region") or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
            if o.get("anon"):
                kw["skip_signature"] = True
            client = self._client_options(str(o.get("endpoint_url") or "").startswith("http://"))
            store = S3Store(bucket, client_options=client, retry_config=self._retry_config(), **kw)
            self._stores[bucket] = store  # a race makes two stores for one bucket: harmless
        return store

    @staticmethod
    def split(url: str) -> tuple[str, str]:
        bucket, _, key = url.split("://", 1)[1].partition("/")
        return bucket, key

    def _call(self, what: str, url: str, fn):
        import obstore.exceptions as ox

        try:
            return fn()
        except (ox.NotFoundError, FileNotFoundError):
            raise FileNotFoundError(f"no such object: {url}") from None
        except (ox.BaseError, OSError, ValueError) as e:
            raise self._fail(what, url, e) from None

    def read(self, url: str, start: int | None = None, end: int | None = None):
        import obstore

        bucket, key = self.split(url)
        store = self._store(bucket)
        if start is None and end is None:
            return self._call("read", url, lambda: obstore.get(store, key).bytes())
        if end is None:
            return self._call("read", url, lambda: obstore.get(store, key, options={"range": {"offset": start}}).bytes())
        return self._call("read", url, lambda: obstore.get_range(store, key, start=start or 0, end=end))

    def info(self, url: str) -> dict[str, Any]:
        import obstore

        bucket, key = self.split(url)
        meta = self._call("read", url, lambda: obstore.head(self._store(bucket), key))
        return {"size": int(meta["size"]), "version": str(meta.get("e_tag") or meta.get("last_modified") or "")}

    def list_files(self, url: str) -> dict[str, dict[str, Any]]:
        import obstore

        bucket, key = self.split(url.rstrip("/"))
        prefix = key + "/" if key else ""
        out: dict[str, dict[str, Any]] = {}

        def run():
            for chunk in obstore.list(self._store(bucket), prefix=prefix or None, chunk_size=1000):
                for meta in chunk:
                    path = meta["path"]
                    if path.startswith(prefix) and not path.endswith("/"):
                        out[path[len(prefix):]] = {"size": int(meta["size"]), "ETag": meta.get("e_tag") or "",
                                                   "LastModified": str(meta.get("last_modified") or "")}

        self._call("list", url, run)
        return out

    def open(self, url: str, block_size: int):
        """A seekable binary file object reading ``url`` in ``block_size`` requests."""
        import obstore

        bucket, key = self.split(url)
        reader = self._call("read", url, lambda: obstore.open_reader(self._store(bucket), key, buffer_size=block_size))
        return _BytesFile(reader)

    def download(self, url: str, dest: str) -> None:
        import obstore

        bucket, key = self.split(url)

        def run():
            with open(dest, "wb") as f:
                for chunk in obstore.get(self._store(bucket), key).stream(min_chunk_size=8 << 20):
                    f.write(chunk)

        self._call("read", url, run)


class _BytesFile(io.RawIOBase):
    """obstore's ReadableFile with ``read`` returning ``bytes`` (tarfile needs real bytes)."""

    def __init__(self, reader):
        super().__init__()
        self._reader = reader

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        return bytes(self._reader.read(size) if size is not None and size >= 0 else self._reader.read())

    def readinto(self, buffer) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._reader.seek(offset, whence)

    def tell(self) -> int:
        return self._reader.tell()

    def close(self) -> None:
        if not self.closed:
            self._reader.close()
        super().close()
