"""``http(s)://`` reads through obstore's ``HTTPStore`` (Rust's ``object_store``), one store per origin.

fsspec's HTTP filesystem has timeouts but no retries; object_store retries 5xx, 429, connection
errors and timeouts of these read-only requests with exponential backoff and jitter (the same
``RetryConfig`` as ``_obstore.ObstoreS3``: ``max_retries = max_attempts - 1``, 200 ms initial,
base 2, 15 s cap), and ``timeout_s`` is the connect and whole-request timeout. URLs with user
info or a query string (presigned URLs, tokens) are not served here: obstore paths cannot carry
them, and the caller keeps fsspec for those (and for listing, which HTTP has not).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote, urlsplit

from ._obstore import ObstoreS3


class ObstoreHTTP(ObstoreS3):
    """Reads ``http(s)://host[:port]/path`` URLs with one ``HTTPStore`` per origin (made on first use).

    ``read``, ``info``, ``open``, ``download`` as ``ObstoreS3``'s (FileNotFoundError ``no such
    object: URL`` on 404, the ``fail`` callable's exception for anything else after retries);
    ``list_files`` raises the ``fail`` exception (HTTP has no listing; Storage keeps fsspec for it).
    """

    @staticmethod
    def serves(url: str) -> bool:
        """True for an http(s) URL without user info, query or fragment."""
        parts = urlsplit(url)
        return (parts.scheme.lower() in ("http", "https") and bool(parts.hostname) and not parts.username
                and not parts.password and not parts.query and not parts.fragment)

    def _store(self, origin: str):
        store = self._stores.get(origin)
        if store is None:
            from obstore.store import HTTPStore

            store = HTTPStore.from_url(origin, client_options=self._client_options(origin.startswith("http://")),
                                       retry_config=self._retry_config())
            self._stores[origin] = store  # a race makes two stores for one origin: harmless
        return store

    @staticmethod
    def split(url: str) -> tuple[str, str]:
        parts = urlsplit(url)
        return f"{parts.scheme.lower()}://{parts.netloc}", unquote(parts.path.lstrip("/"))

    def read(self, url: str, start: int | None = None, end: int | None = None):
        """Bytes ``[start, end)`` of ``url``; a server that ignores Range is read whole and sliced."""
        import obstore
        import obstore.exceptions as ox

        if start is None and end is None:
            return super().read(url)
        origin, key = self.split(url)
        store = self._store(origin)

        def run():
            try:
                if end is None:
                    return obstore.get(store, key, options={"range": {"offset": start}}).bytes()
                return obstore.get_range(store, key, start=start or 0, end=end)
            except ox.NotSupportedError:  # no Range support (e.g. python -m http.server)
                return bytes(obstore.get(store, key).bytes())[start or 0:end]

        return self._call("read", url, run)

    def list_files(self, url: str) -> dict[str, dict[str, Any]]:
        raise self._fail("list", url, ValueError("an http(s) URL cannot be listed; give a manifest or a list of shard URLs"))


__all__ = ["ObstoreHTTP"]
