"""Where dataset files live: local paths or URLs (``s3://``, ``gs://``, ``http(s)://``, ``file://``).

``s3://`` and ``gs://`` roots go through obstore (``_obstore.py``, ``_obstore_gcs.py``; ``backend:
fsspec`` for s3fs/gcsfs), ``http(s)://`` through obstore's HTTPStore, the rest through fsspec.
``StorageOptions`` is the ``storage_options`` block of a dataset config: fsspec/s3fs's own names (``endpoint_url``,
``key``, ``secret``, ``token``, ``region``, ``anon``, and any other keyword the filesystem
takes), credentials that may come from a file the config names, and batchd's retry and timeout
settings. Secrets are ``SecretStr`` (``repr``, logs and ``model_dump`` show ``**********``);
``Storage.open`` hands the real values to fsspec only.

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
import posixpath
import re
import stat
import threading
from collections.abc import Iterator
from typing import Any, Literal
from urllib.parse import urlsplit, urlunsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
# storage_options keys whose values are credentials (also among the extra, filesystem-specific keys)
SECRET_KEYS = frozenset({"key", "secret", "token", "password", "session_token", "client_secret",
                         "aws_access_key_id", "aws_secret_access_key", "aws_session_token", "account_key", "sas_token",
                         "service_account_key", "google_service_account_key", "bearer_token", "google_bearer_token"})


def is_url(location: str | os.PathLike[str]) -> bool:
    """True if ``location`` is ``scheme://...`` (``file://`` included)."""
    return isinstance(location, str) and bool(_URL.match(location))


def is_remote(location: str | os.PathLike[str]) -> bool:
    """True for a URL other than ``file://`` (the bytes are not on a local filesystem)."""
    return is_url(location) and not str(location).lower().startswith("file://")


def read_local(path: str, start: int = 0, end: int | None = None) -> bytes:
    """Bytes ``[start, end)`` of a local file (to its end by default), in as few system calls as
    possible: open, fstat, pread until the range is read, close (``open(path, "rb").read()`` makes
    about twice as many); pipes, devices and files of reported size 0 are read to their end. Each
    call releases and retakes the GIL, which costs CPU when a worker's 32 I/O threads contend for
    it on slow storage. Raises OSError (FileNotFoundError for a missing file)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or (end is None and st.st_size == 0):
            # a pipe or device, or a file system that reports no size: read to the end, as open().read() does
            with open(fd, "rb", closefd=False) as f:
                if start:
                    f.seek(start)
                return f.read() if end is None else f.read(end - start)
        stop = st.st_size if end is None else end
        parts, offset = [], start
        while offset < stop:
            chunk = os.pread(fd, stop - offset, offset)
            if not chunk:  # the file is shorter than it said (or than ``end``)
                break
            parts.append(chunk)
            offset += len(chunk)
        return parts[0] if len(parts) == 1 else b"".join(parts)
    finally:
        os.close(fd)


def local_path(location: str | os.PathLike[str]) -> str:
    """``file:///a/b`` -> ``/a/b``; a plain path made absolute. Raises ValueError for a remote URL."""
    text = os.fspath(location)
    if is_remote(text):
        raise ValueError(f"{safe_url(text)} is not a local path")
    if is_url(text):
        text = urlsplit(text).path
    return os.path.abspath(text)


def safe_url(url: str) -> str:
    """``url`` without user info, query or fragment (where presigned URLs and passwords hide)."""
    if not is_url(url):
        return url
    parts = urlsplit(url)
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, host, parts.path, "", ""))


def join(root: str, rel: str) -> str:
    """``rel`` inside ``root``: a full URL ``rel`` is used as is; a local root joins like
    ``os.path.join`` (an absolute ``rel`` wins); a URL root gets ``root/rel``."""
    if is_url(rel):
        return rel
    if is_url(root):
        return root.rstrip("/") + "/" + rel.lstrip("/")
    return os.path.join(root, rel)


class StorageOptions(BaseModel):
    """A dataset's ``storage_options`` (only used for URLs).

    endpoint_url: an S3-compatible server, e.g. ``http://10.0.0.5:8333`` (SeaweedFS, MinIO).
    key, secret, token: credentials (access key id, secret key, session token). Unset: the
        library's own chain (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY`` in the environment,
        ``~/.aws/credentials``, instance metadata).
    region: the S3 region (``client_kwargs.region_name`` in s3fs).
    anon: true for public buckets (no signing).
    credentials_file: a YAML or JSON mapping of further options (typically ``key``, ``secret``),
        read when the dataset opens; values in the config win.
    max_attempts: attempts per request, the first included (botocore's standard retry mode:
        exponential backoff with jitter on throttling, 5xx and connection errors). Default 10
        (object_store's default; the retries of one request stop after 4 x timeout_s, at least 60 s).
    timeout_s: connect timeout and read timeout per request, seconds. Default 30.
    backend: what reads ``s3://`` and ``gs://`` URLs: "obstore" (default; about 10x less latency and
        CPU per object than s3fs, measured) or "fsspec" (s3fs, which takes any further s3fs keyword,
        e.g. ``client_kwargs``; gcsfs, not a batchd dependency). For ``gs://`` with obstore the
        credential names are object_store's (``service_account`` file, ``service_account_key``,
        ``application_credentials``, ``bearer_token``), gcsfs's ``token`` and ``anon``; see
        ``_obstore_gcs.py``.
    Other keys go to the fsspec filesystem as they are (e.g. gcsfs's ``project``); those named
    like credentials (``SECRET_KEYS``) are kept as secrets too.
    """

    model_config = ConfigDict(extra="allow", frozen=True)

    endpoint_url: str | None = None
    key: SecretStr | None = None
    secret: SecretStr | None = None
    token: SecretStr | None = None
    region: str | None = None
    anon: bool | None = None
    credentials_file: pathlib.Path | None = None
    max_attempts: int = Field(default=10, ge=1, le=50)
    timeout_s: float = Field(default=30.0, gt=0)
    backend: Literal["obstore", "fsspec"] = "obstore"

    @model_validator(mode="after")
    def _hide_extra_secrets(self) -> "StorageOptions":
        for name, value in (self.__pydantic_extra__ or {}).items():
            if name in SECRET_KEYS and not isinstance(value, SecretStr):
                self.__pydantic_extra__[name] = SecretStr(str(value))
        return self

    def secret_values(self) -> list[str]:
        """Every credential value set here or in ``credentials_file`` (for redaction; never log it)."""
        return [str(v) for k, v in self.resolved().items() if k in SECRET_KEYS and v]

    def resolved(self) -> dict[str, Any]:
        """Plain options (secrets revealed) with ``credentials_file`` merged in, None values dropped.

        Raises ValueError naming the credentials file if it cannot be read or is not a mapping.
        """
        out: dict[str, Any] = {}
        if self.credentials_file is not None:
            path = self.credentials_file
            try:
                loaded = yaml.safe_load(path.read_text())
            except OSError as e:
                raise ValueError(f"storage_options.credentials_file {path}: {e.strerror}") from None
            except yaml.YAMLError:
                raise ValueError(f"storage_options.credentials_file {path}: not YAML or JSON") from None
            if not isinstance(loaded, dict):
                raise ValueError(f"storage_options.credentials_file {path}: expected a mapping such as {{key: ..., secret: ...}}")
            out.update(loaded)
        for name in [*type(self).model_fields, *(self.__pydantic_extra__ or {})]:
            if name in ("credentials_file", "max_attempts", "timeout_s", "backend"):
                continue
            value = getattr(self, name)
            if isinstance(value, SecretStr):
                value = value.get_secret_value()
            if value is not None:
                out[name] = value
        return out

    def fingerprint_part(self) -> dict[str, Any]:
        """What identifies the storage without credentials (cache keys): endpoint, region."""
        return {"endpoint_url": self.endpoint_url, "region": self.region}


def fsspec_options(protocol: str, options: StorageOptions) -> dict[str, Any]:
    """Keyword arguments for ``fsspec.filesystem(protocol, ...)``: our names mapped to the library's,
    with retries and timeouts set."""
    kw = options.resolved()
    if protocol in ("s3", "s3a"):
        region = kw.pop("region", None)
        client_kwargs = dict(kw.pop("client_kwargs", {}) or {})
        if region:
            client_kwargs.setdefault("region_name", region)
        elif kw.get("endpoint_url"):
            client_kwargs.setdefault("region_name", "us-east-1")  # S3-compatible servers ignore it; botocore wants one
        kw["client_kwargs"] = client_kwargs
        config_kwargs = dict(kw.pop("config_kwargs", {}) or {})
        config_kwargs.setdefault("retries", {"max_attempts": options.max_attempts, "mode": "standard"})
        config_kwargs.setdefault("connect_timeout", options.timeout_s)
        config_kwargs.setdefault("read_timeout", options.timeout_s)
        kw["config_kwargs"] = config_kwargs
    elif protocol in ("gs", "gcs"):
        kw.pop("region", None)
        kw.setdefault("timeout", options.timeout_s)
    elif protocol in ("http", "https"):
        import aiohttp

        kw.setdefault("client_kwargs", {"timeout": aiohttp.ClientTimeout(total=None, connect=options.timeout_s,
                                                                         sock_read=options.timeout_s)})
    return kw


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


def parent(location: str) -> str:
    """The folder or prefix holding ``location``."""
    if is_url(location):
        return location.rstrip("/").rsplit("/", 1)[0]
    return os.path.dirname(location)


def basename(location: str) -> str:
    return posixpath.basename(location.rstrip("/")) if is_url(location) else os.path.basename(location)



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
