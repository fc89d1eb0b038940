"""Who may connect and what a client may ask for: the ``tls``, ``auth`` and ``pipeline_limits`` blocks.

Example::

    tls: {cert: /etc/batchd/server.pem, key: /etc/batchd/server.key}
    auth:
      tokens:
        - {name: trainer, token_env: BATCHD_TOKEN, datasets: ["*"]}
    pipeline_limits: {max_transforms: 32}
"""

from __future__ import annotations

import os
import pathlib

from pydantic import Field, PrivateAttr, SecretStr, field_validator, model_validator

from .base import StrictModel


class TlsConfig(StrictModel):
    """TLS for the gRPC port (PEM files, read when the server starts).

    cert, key: the server's certificate (chain) and private key.
    client_ca: CA certificates that client certificates must chain to; with it, clients may
        present a certificate (verified if they do).
    require_client_cert: refuse clients without a valid certificate (mutual TLS); needs client_ca.
    """

    cert: pathlib.Path
    key: pathlib.Path
    client_ca: pathlib.Path | None = None
    require_client_cert: bool = False

    @field_validator("cert", "key", "client_ca")
    @classmethod
    def _readable(cls, v: pathlib.Path | None) -> pathlib.Path | None:
        if v is not None and not os.access(v, os.R_OK):
            raise ValueError(f"cannot read {v}")
        return v

    @model_validator(mode="after")
    def _check_client_ca(self) -> "TlsConfig":
        if self.require_client_cert and self.client_ca is None:
            raise ValueError("require_client_cert needs client_ca (the CA that signs client certificates)")
        return self


MIN_TOKEN_CHARS = 16


class TokenConfig(StrictModel):
    """One bearer token and the datasets it may read.

    name: shown in logs and errors (the token itself never is).
    token: the secret itself, or token_env: the environment variable holding it (one of the two).
    datasets: dataset names this token may read, or ["*"] for all.
    """

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.@-]*$")
    token: SecretStr | None = None
    token_env: str | None = Field(default=None, min_length=1)
    datasets: tuple[str, ...] = Field(min_length=1)
    _secret: str = PrivateAttr(default="")

    @model_validator(mode="after")
    def _resolve(self) -> "TokenConfig":
        if (self.token is None) == (self.token_env is None):
            raise ValueError(f"token {self.name!r}: give exactly one of token or token_env")
        if self.token is not None:
            secret = self.token.get_secret_value()
        else:
            secret = os.environ.get(self.token_env, "")
            if not secret:
                raise ValueError(f"token {self.name!r}: environment variable {self.token_env} is not set or empty")
        secret = secret.strip()
        if len(secret) < MIN_TOKEN_CHARS or any(c.isspace() for c in secret) or not secret.isprintable():
            raise ValueError(f"token {self.name!r}: a token must be at least {MIN_TOKEN_CHARS} printable characters "
                             "without spaces (e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))'`)")
        self._secret = secret
        return self

    @property
    def secret(self) -> str:
        """The token's value (never log it)."""
        return self._secret

    @property
    def all_datasets(self) -> bool:
        return "*" in self.datasets


class AuthConfig(StrictModel):
    """Bearer-token authentication: clients send ``authorization: Bearer <token>`` metadata."""

    tokens: tuple[TokenConfig, ...] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique(self) -> "AuthConfig":
        names = [t.name for t in self.tokens]
        if len(set(names)) != len(names):
            raise ValueError(f"token names must be unique: {names}")
        if len({t.secret for t in self.tokens}) != len(self.tokens):
            raise ValueError("two tokens have the same value; give each client its own")
        return self


class PipelineLimits(StrictModel):
    """Bounds on albumentations pipelines that clients send (presets in the server config are trusted).

    max_json_bytes: the pipeline's JSON text. max_transforms: transforms in it, compositions
    included. max_depth: nesting of compositions (a Compose of transforms is 1).
    max_side, max_pixels: output height/width, and height x width, of resizes, crops and pads.
    max_kernel: blur kernels and sigmas, CLAHE tiles.
    """

    max_json_bytes: int = Field(default=64 * 1024, ge=1024)
    max_transforms: int = Field(default=64, ge=1)
    max_depth: int = Field(default=4, ge=1, le=16)
    max_side: int = Field(default=4096, ge=1)
    max_pixels: int = Field(default=4096 * 4096, ge=1)
    max_kernel: int = Field(default=255, ge=3)
