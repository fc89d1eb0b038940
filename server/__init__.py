"""batchd.server: samples -> batches (the loader server). No module of it imports torch.

albumentations imports its ``albumentations.pytorch`` part, and with it torch (about 3 s and a
few hundred MB per process), whenever torch is installed. The server and its workers never use
it (pipelines return arrays; ``ToTensorV2`` is not allowlisted), so albumentations is imported
here with that part held back. ``import albumentations.pytorch`` still works afterwards for
anyone who asks for it explicitly (a client in the same process, a test).
"""

from __future__ import annotations

import sys


def _import_albumentations_without_torch() -> None:
    if "albumentations" in sys.modules:
        return  # imported already (by a client or a test in this process): nothing to hold back
    held = "albumentations.pytorch" not in sys.modules
    if held:
        sys.modules["albumentations.pytorch"] = None  # `from .pytorch import *` raises ImportError, which albumentations suppresses
    try:
        import albumentations  # noqa: F401
    finally:
        if held and sys.modules.get("albumentations.pytorch", False) is None:
            del sys.modules["albumentations.pytorch"]


_import_albumentations_without_torch()
