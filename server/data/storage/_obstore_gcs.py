"""``gs://`` reads through obstore's ``GCSStore`` (Rust's ``object_store``), one store per bucket.

The default backend for ``gs://`` datasets (``backend: fsspec`` keeps gcsfs, which batchd does not
depend on). Retries and timeouts are the S3 backend's (``ObstoreS3._retry_config`` and
``_client_options``: ``max_retries = max_attempts - 1``, exponential backoff with jitter, 200 ms
initial, base 2, 15 s cap; ``timeout_s`` to connect and per request).

``storage_options`` for GCS, mapped by ``gcs_store_kwargs``:

- ``service_account`` (or ``google_service_account``, ``google_service_account_path``): the path
  of a service-account JSON key file. An emulator's file may carry
  ``"gcs_base_url": "http://127.0.0.1:4443", "disable_oauth": true`` (object_store's way to reach
  fake-gcs-server; tests/data/test_gcs.py does it).
- ``service_account_key`` (or ``google_service_account_key``): the JSON key itself (a secret).
- ``application_credentials`` (or ``google_application_credentials``): an application-default
  credentials file (``gcloud auth application-default login`` writes one).
- ``bearer_token`` (or ``google_bearer_token``): a static OAuth access token (a secret).
- ``token``: gcsfs's meanings: ``anon``, ``google_default``/``cloud`` (the default chain), or the
  path of a credentials file (as ``application_credentials``).
- ``anon: true``: no credentials, unsigned requests (public buckets, emulators).
- ``endpoint_url``: another endpoint than Google's, e.g. an emulator ``http://127.0.0.1:4443``.

Unset, object_store's own chain applies: ``GOOGLE_SERVICE_ACCOUNT``,
``GOOGLE_APPLICATION_CREDENTIALS`` and the other ``GOOGLE_*`` variables, then the
metadata server of a GCE/GKE machine.
"""

from __future__ import annotations

import json
import os
from typing import Any

from ._obstore import ObstoreS3

_ALIASES = {
    "service_account": ("service_account", "google_service_account", "google_service_account_path"),
    "service_account_key": ("service_account_key", "google_service_account_key"),
    "application_credentials": ("application_credentials", "google_application_credentials"),
    "bearer_token": ("bearer_token", "google_bearer_token"),
}
# gcsfs's ``token`` values that mean "the default credential chain"
_DEFAULT_CHAIN = ("google_default", "cloud", "cache")


def gcs_store_kwargs(options: dict[str, Any]) -> dict[str, Any]:
    """``GCSStore`` keyword arguments (``base_url``, ``service_account``, ``skip_signature``, ...)
    from resolved ``storage_options`` (secrets revealed; see the module docstring for the names).

    Raises ValueError naming the option (never its value) for two names of one setting with
    different values, or a gcsfs ``token`` that is neither a mode gcsfs knows nor an existing file.
    """
    kw: dict[str, Any] = {}
    for name, aliases in _ALIASES.items():
        given = {a: options[a] for a in aliases if options.get(a)}
        if len(set(map(str, given.values()))) > 1:
            raise ValueError(f"storage_options: {' and '.join(given)} name one setting with different values; keep one")
        if given:
            kw[name] = os.fspath(next(iter(given.values())))
    token = options.get("token")
    if token:
        if token == "anon":
            kw["skip_signature"] = True
        elif token not in _DEFAULT_CHAIN:
            if not os.path.isfile(token):
                raise ValueError("storage_options.token for gs:// is gcsfs's: 'anon', 'google_default', 'cloud' or the "
                                 "path of a credentials file, and this is none of them (an OAuth access token goes in "
                                 "bearer_token)")
            kw.setdefault("application_credentials", token)
    if options.get("anon"):
        kw["skip_signature"] = True
    if options.get("endpoint_url"):
        kw["base_url"] = str(options["endpoint_url"]).rstrip("/")
    return kw


class ObstoreGCS(ObstoreS3):
    """Reads ``gs://bucket/key`` URLs with one ``GCSStore`` per bucket (made on first use).

    ``read``, ``info``, ``list_files``, ``open``, ``download`` as ``ObstoreS3``'s: FileNotFoundError
    ``no such object: URL`` for a missing object, the ``fail`` callable's exception for anything
    else after retries. Raises ValueError on construction for options ``gcs_store_kwargs`` refuses.
    """

    def __init__(self, options: dict[str, Any], *, max_attempts: int, timeout_s: float, fail):
        super().__init__(options, max_attempts=max_attempts, timeout_s=timeout_s, fail=fail)
        self._kwargs = gcs_store_kwargs(options)

    def _base_url(self) -> str:
        """The endpoint: ``endpoint_url``, else a service-account key's ``gcs_base_url`` (an emulator's),
        else ""; a key that cannot be read gives "" here and object_store's own error later."""
        if "base_url" in self._kwargs:
            return self._kwargs["base_url"]
        try:
            if "service_account_key" in self._kwargs:
                account = json.loads(self._kwargs["service_account_key"])
            elif "service_account" in self._kwargs:
                with open(self._kwargs["service_account"], "rb") as f:
                    account = json.load(f)
            else:
                return ""
        except (OSError, ValueError):
            return ""
        return str(account.get("gcs_base_url") or "") if isinstance(account, dict) else ""

    def _store(self, bucket: str):
        store = self._stores.get(bucket)
        if store is None:
            from obstore.store import GCSStore

            client = self._client_options(self._base_url().startswith("http://"))
            store = GCSStore(bucket, client_options=client, retry_config=self._retry_config(), **self._kwargs)
            self._stores[bucket] = store  # a race makes two stores for one bucket: harmless
        return store


__all__ = ["ObstoreGCS", "gcs_store_kwargs"]
