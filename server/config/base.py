"""The base of every block of the server's YAML config (server/config/__init__.py and its parts)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class StrictModel(BaseModel):
    """A config block that refuses unknown fields (a typo is an error naming the field) and is frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True)
