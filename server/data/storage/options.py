"""``StorageOptions``: the ``storage_options`` block of a dataset config, and what the storage
libraries are given from it.

fsspec/s3fs's own names (``endpoint_url``, ``key``, ``secret``, ``token``, ``region``, ``anon``,
and any other keyword the filesystem takes), credentials that may come from a file the config
names, and batchd's retry and timeout settings. Secrets are ``SecretStr`` (``repr``, logs and
``model_dump`` show ``**********``); ``Storage.open`` hands the real values to fsspec only
(``fsspec_options``).
"""

from __future__ import annotations

import pathlib
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

# storage_options keys whose values are credentials (also among the extra, filesystem-specific keys)
SECRET_KEYS = frozenset({"key", "secret", "token", "password", "session_token", "client_secret",
                         "aws_access_key_id", "aws_secret_access_key", "aws_session_token", "account_key", "sas_token",
                         "service_account_key", "google_service_account_key", "bearer_token", "google_bearer_token"})


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
