"""``Storage``: reading bytes from local paths and URLs, whatever library serves them.

``s3://`` and ``gs://`` roots go through obstore (``_obstore.py``, ``_obstore_gcs.py``; ``backend:
fsspec`` for s3fs/gcsfs), ``http(s)://`` through obstore's HTTPStore, the rest through fsspec,
each with the dataset's ``StorageOptions`` (``options.py``).

Retries are the storage library's own: for S3, botocore's ``standard`` retry mode
(exponential backoff with full jitter on throttling, 5xx, and connection errors, up to
``max_attempts`` attempts) plus a connect and a read timeout per request (``timeout_s``); gcsfs
retries on its own; obstore (``s3://``, ``gs://``, ``http(s)://``) retries with backoff and
jitter too; the http(s) reads left to fsspec (presigned URLs, user info), which has no retries,
are retried with tenacity under the same policy (``_fsspec_retry.py``). A read that still fails
raises ``StorageError`` with the URL (user info and query removed, so no credential) and the
error's type and message.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import re
import threading
from collections.abc import Iterator
from typing import Any

from .locations import basename, is_remote, local_path, read_local, safe_url
from .options import StorageOptions, fsspec_options


class StorageError(OSError):
    """A read from storage failed after the library's retries; the message names the URL (no
    credentials) and the error."""


class Storage:
    """Reads bytes from local paths and URLs with one set of ``StorageOptions``.

    Filesystems are made on first use, one per protocol, in the process that uses them (each
    worker opens its own; thread-safe). ``options`` apply to the protocol of ``root``; other
    protocols (full URLs in a manifest) get fsspec's defaults plus our retries and timeouts.
    """

    def __init__(self, root: str, options: StorageOptions | None = None):
        self.root = root
        self.options = options if options is not None else StorageOptions()
        self._root_protocol = self.protocol(root)
        self._fs: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._bucket = None  # the root's bucket store: ObstoreS3 for s3://, ObstoreGCS for gs://
        if self._root_protocol in ("s3", "s3a", "gs", "gcs") and self.options.backend == "obstore":
            from ._obstore import ObstoreS3
            from ._obstore_gcs import ObstoreGCS

            bucket_store = ObstoreGCS if self._root_protocol in ("gs", "gcs") else ObstoreS3
            self._bucket = bucket_store(self.options.resolved(), max_attempts=self.options.max_attempts,
                                       timeout_s=self.options.timeout_s, fail=self._error)
        self._http = None
        if self.options.backend == "obstore":  # http(s) reads with retries (fsspec's have none)
            from ._obstore_http import ObstoreHTTP

            self._http = ObstoreHTTP({}, max_attempts=self.options.max_attempts,
                                     timeout_s=self.options.timeout_s, fail=self._error)
        self._secrets = [v for v in self.options.secret_values() if len(v) >= 4]

    def _error(self, what: str, url: str, e: BaseException) -> "StorageError":
        """A StorageError for ``what`` (read/list) of ``url``: safe URL, error type and message,
        with any credential value replaced by ``<redacted>``."""
        text = describe(e)
        for secret in self._secrets:
            text = text.replace(secret, "<redacted>")
        return StorageError(f"cannot {what} {safe_url(url)}: {text}")

    def _obstore(self, location: str):
        """The obstore backend if it serves ``location``: an s3:// or gs:// URL with the root's
        options, or an http(s) URL without user info or query (unless ``backend: fsspec``)."""
        if self._bucket is not None and self.protocol(location) == self._root_protocol:
            return self._bucket
        if self._http is not None and self.protocol(location) in ("http", "https") and self._http.serves(location):
            return self._http
        return None

    def _retried(self, location: str, fn):
        """``fn()`` with retries for http(s) through fsspec (no retries of its own: _fsspec_retry);
        other protocols' libraries retry themselves (botocore, gcsfs)."""
        if self.protocol(location) not in ("http", "https"):
            return fn()
        from ._fsspec_retry import call

        return call(fn, max_attempts=self.options.max_attempts, timeout_s=self.options.timeout_s)

    @staticmethod
    def protocol(location: str) -> str:
        return location.split("://", 1)[0].lower() if is_remote(location) else "file"

    def filesystem(self, location: str):
        """The fsspec filesystem for ``location``'s protocol (made once)."""
        proto = self.protocol(location)
        fs = self._fs.get(proto)
        if fs is None:
            import fsspec

            with self._lock:
                fs = self._fs.get(proto)
                if fs is None:
                    opts = self.options if proto == self._root_protocol else StorageOptions(
                        max_attempts=self.options.max_attempts, timeout_s=self.options.timeout_s)
                    fs = fsspec.filesystem(proto, **(fsspec_options(proto, opts) if proto != "file" else {}))
                    if proto in ("s3", "s3a"):
                        fs.retries = 1  # s3fs's own loop (fixed backoff, no jitter) off: botocore retries
                    self._fs[proto] = fs
        return fs

    def read(self, location: str, start: int | None = None, end: int | None = None) -> bytes:
        """Bytes ``[start, end)`` of ``location`` (a local path or URL); the whole file by default.

        Raises FileNotFoundError for a missing local file or object (message: the safe URL),
        StorageError for any other failure after retries.
        """
        if not is_remote(location):
            return read_local(local_path(location), start or 0, end)
        if (s3 := self._obstore(location)) is not None:
            return s3.read(location, start, end)
        try:
            return self._retried(location, lambda: self.filesystem(location).cat_file(location, start=start, end=end))
        except FileNotFoundError:
            raise FileNotFoundError(f"no such object: {safe_url(location)}") from None
        except Exception as e:  # botocore/aiohttp errors have no common base
            raise self._error("read", location, e) from None

    def info(self, location: str) -> dict[str, Any]:
        """Size and version of ``location``: ``{"size": bytes, "version": ETag or mtime}``.

        Raises FileNotFoundError naming the safe URL, StorageError otherwise.
        """
        if not is_remote(location):
            st = os.stat(local_path(location))
            return {"size": st.st_size, "version": st.st_mtime_ns}
        if (s3 := self._obstore(location)) is not None:
            return s3.info(location)
        try:
            info = self._retried(location, lambda: self.filesystem(location).info(location))
        except FileNotFoundError:
            raise FileNotFoundError(f"no such object: {safe_url(location)}") from None
        except Exception as e:
            raise self._error("read", location, e) from None
        return {"size": int(info.get("size") or 0), "version": str(info.get("ETag") or info.get("etag") or
                                                                   info.get("LastModified") or info.get("mtime") or "")}

    def list_files(self, location: str) -> dict[str, dict[str, Any]]:
        """Every object under the prefix ``location`` (recursively): key relative to it -> info.

        Raises FileNotFoundError if there is none, StorageError if listing fails.
        """
        if (s3 := self._obstore(location)) is not None and s3 is self._bucket:  # http(s): fsspec's link scraping
            out = s3.list_files(location)
        else:
            fs = self.filesystem(location)
            try:
                found = fs.find(location, withdirs=False, detail=True)
            except FileNotFoundError:
                found = {}
            except Exception as e:
                raise self._error("list", location, e) from None
            base = fs._strip_protocol(location).rstrip("/") + "/"
            out = {}
            for path, info in found.items():
                if path.startswith(base) and info.get("type", "file") == "file":
                    out[path[len(base):]] = info
        if not out:
            raise FileNotFoundError(f"{safe_url(location)}: no objects under this prefix")
        return out

    def open(self, location: str, block_size: int = 16 << 20):
        """A seekable binary file object for ``location``, reading ahead ``block_size`` bytes per
        request (for a sequential pass, e.g. indexing a tar shard). Raises as ``read``."""
        if not is_remote(location):
            return open(local_path(location), "rb", buffering=block_size)
        if (s3 := self._obstore(location)) is not None:
            return s3.open(location, block_size)
        try:
            return self.filesystem(location).open(location, "rb", block_size=block_size, cache_type="readahead")
        except FileNotFoundError:
            raise FileNotFoundError(f"no such object: {safe_url(location)}") from None
        except Exception as e:
            raise self._error("read", location, e) from None

    def download(self, location: str, dest: str | os.PathLike[str]) -> None:
        """Copy ``location`` to the local file ``dest`` (streamed). Raises as ``read``."""
        if (s3 := self._obstore(location)) is not None:
            return s3.download(location, os.fspath(dest))
        try:
            self._retried(location, lambda: self.filesystem(location).get_file(location, os.fspath(dest)))
        except FileNotFoundError:
            raise FileNotFoundError(f"no such object: {safe_url(location)}") from None
        except Exception as e:
            raise self._error("read", location, e) from None


def describe(e: BaseException) -> str:
    """``Type: message`` of a storage error: URLs in it stripped of credentials, an S3 XML error
    body reduced to its ``Code: Message``, at most 500 characters."""
    text = (str(e) or repr(e)).split("Debug source:")[0]
    body = re.search(r"<\?xml.*", text, re.S)
    if body:
        code = re.search(r"<Code>([^<]*)</Code>", body.group(0))
        message = re.search(r"<Message>([^<]*)</Message>", body.group(0))
        text = text[: body.start()].rstrip(": \n") + "".join(
            f" {m.group(1)}" + (":" if m is code and message else "") for m in (code, message) if m)
    text = re.sub(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"]+", lambda m: safe_url(m.group(0)), text)
    return f"{type(e).__name__}: {' '.join(text.split())}"[:500]


@contextlib.contextmanager
def local_copy(storage: Storage, location: str, scratch: pathlib.Path) -> Iterator[str]:
    """A local path holding ``location``'s bytes: the file itself when local; for a URL, a copy
    streamed to a hidden file beside ``scratch`` (so memory stays as for a local file), deleted
    on exit. Raises as ``Storage.download``."""
    if not is_remote(location):
        yield local_path(location)
        return
    copy = scratch.with_name(f".{scratch.name}.{os.getpid()}.download{os.path.splitext(basename(location))[1]}")
    copy.parent.mkdir(parents=True, exist_ok=True)
    try:
        storage.download(location, copy)
        yield str(copy)
    finally:
        copy.unlink(missing_ok=True)
