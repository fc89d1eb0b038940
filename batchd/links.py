"""Where batchd's documentation lives, for messages that point users at it.

``DOCS_URL`` is the docs site's base (mkdocs.yml's ``site_url``; tests/deploy/test_readme.py
checks that they agree); ``docs_link(page, anchor)`` the address of a page's section there.
"""

from __future__ import annotations

DOCS_URL = "https://batchd.github.io/batchd/"


def docs_link(page: str, anchor: str = "") -> str:
    """The address of ``page`` (a docs/ file name without ``.md``, e.g. ``"tuning"``) and, if
    given, its section ``anchor`` (e.g. ``"cpu-bound"``) on the docs site (directory URLs)."""
    return f"{DOCS_URL}{page}/" + (f"#{anchor}" if anchor else "")
