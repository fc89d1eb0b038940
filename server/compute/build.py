"""The build fingerprint: what turns a dataset's samples into pixels on this server.

Two servers with equal dataset fingerprints and equal build fingerprints send the same bytes
for the same request. The build is a dict of text parts (DescribeDataset's ``build``):

* ``opencv``, ``albumentations``, ``numpy``, ``batchd``: package versions;
* ``jpeg``, ``png``, ``webp``, ``tiff``: the codec libraries OpenCV was built with (from
  ``cv2.getBuildInformation()``; a part is left out when OpenCV does not say);
* ``cv2_threads``: OpenCV threads per worker process (``WORKER_CV2_THREADS``);
* the dataset's decode settings (``Dataset.decode_settings``), e.g. ``reduced_decode`` on/off;
* ``cache``: ``on`` or ``off``, whether the server's decoded-sample cache serves the prefix of
  each pipeline (``cache:`` in its config), and with it ``cache_prefix_rules``: the version of
  the rule that decides which leading transforms are cached (``server/compute/prefix.py``
  ``PREFIX_RULES``). The cache never changes a byte (tests/data/test_cache.py compares a cached
  server's batches with an uncached one's, hit and miss), so these parts say which code served
  a batch but are not part of what clients compare (``BYTES_NEUTRAL``: ``served_fingerprint``);
  the disk cache stamps its entries with the whole build, their rule included.

``build_fingerprint(parts)`` hashes the dict: 32 lowercase hex characters.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import re
from collections.abc import Mapping

# what server/compute/worker.py sets in every worker (cv2.setNumThreads): one worker per core
WORKER_CV2_THREADS = 1
FINGERPRINT_CHARS = 32
_CODECS = {"jpeg": "JPEG", "png": "PNG", "webp": "WEBP", "tiff": "TIFF"}


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _codecs(build_information: str) -> dict[str, str]:
    """``{"jpeg": "libjpeg-turbo 3.1.2-70", "png": "libpng 1.6.58", ...}`` from OpenCV's build
    information: library name (without its folder; none for a bundled "build") and version."""
    found = {}
    for part, label in _CODECS.items():
        m = re.search(rf"^\s*{label}:\s*(\S+)(?:\s*\(ver ([^)]*)\))?", build_information, re.MULTILINE)
        if m:
            name = re.sub(r"^build-?|\.(so|a|dylib|lib)(\.[\d.]+)?$", "", m.group(1).rsplit("/", 1)[-1])
            found[part] = " ".join(x for x in (name, m.group(2)) if x) or m.group(1)
    return found


@functools.cache
def server_build() -> dict[str, str]:
    """The parts of the build that are the same for every dataset of this server (computed once)."""
    import albumentations
    import cv2
    import numpy

    return {
        "opencv": cv2.__version__,
        "albumentations": albumentations.__version__,
        "numpy": numpy.__version__,
        "batchd": _version("batchd"),
        "cv2_threads": str(WORKER_CV2_THREADS),
        **_codecs(cv2.getBuildInformation()),
    }


def build_parts(decode_settings: Mapping[str, str] | None = None, *, cache: bool = False) -> dict[str, str]:
    """``server_build()`` plus a dataset's ``decode_settings`` (name -> text) and the cache parts
    (``cache``: on/off; ``cache_prefix_rules`` when on), as a new dict."""
    parts = {**server_build(), **{str(k): str(v) for k, v in (decode_settings or {}).items()}}
    parts["cache"] = "on" if cache else "off"
    if cache:
        from batchd.server.compute.prefix import PREFIX_RULES

        parts["cache_prefix_rules"] = PREFIX_RULES
    return parts


BYTES_NEUTRAL = ("cache", "cache_prefix_rules")  # build parts that never change a batch's bytes


def served_fingerprint(parts: Mapping[str, str]) -> str:
    """The build fingerprint a server describes (``DatasetInfo.build_fingerprint``): of the parts
    that decide the bytes, ``BYTES_NEUTRAL`` left out (a cached and an uncached server send the
    same bytes, and a loader under ``strict`` reads both)."""
    return build_fingerprint({k: v for k, v in parts.items() if k not in BYTES_NEUTRAL})


def build_fingerprint(parts: Mapping[str, str]) -> str:
    """A hash of ``parts`` (order does not matter): 32 lowercase hex characters."""
    text = json.dumps({str(k): str(v) for k, v in parts.items()}, sort_keys=True)
    return hashlib.sha256(f"batchd-build/1\0{text}".encode()).hexdigest()[:FINGERPRINT_CHARS]
