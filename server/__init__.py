"""batchd.server: samples -> batches (the loader server). No module of it imports torch.

albumentations imports its ``albumentations.pytorch`` part, and with it torch (about 3 s and a
few hundred MB per process), whenever torch is installed: once when albumentations is imported,
and again in every ``A.from_dict`` (``register_additional_transforms``). The server and its
workers never use it (pipelines return arrays; ``ToTensorV2`` is not allowlisted), so
albumentations is imported here with that part held back, and ``from_dict`` registers it only in
a process that has loaded torch already (a client or a test beside the server). ``import
albumentations.pytorch`` still works for anyone who asks for it explicitly.
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
    from albumentations.core import serialization

    register = serialization.register_additional_transforms

    def register_unless_torch_would_load() -> None:
        if "torch" in sys.modules:  # a client's process: what albumentations does
            register()

    serialization.register_additional_transforms = register_unless_torch_would_load


_import_albumentations_without_torch()
