"""What a run of the suite was asked for: quick or full, repeats, where results go."""

from __future__ import annotations

import pathlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Settings:
    quick: bool = False
    repeats: int = 3
    out_dir: pathlib.Path = pathlib.Path(__file__).resolve().parent / "results"

    def pick(self, full, quick):
        """``quick`` in a --quick run, else ``full``."""
        return quick if self.quick else full
