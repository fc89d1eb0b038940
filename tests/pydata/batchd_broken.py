"""A module whose import fails with its own error (tests/data/test_python_dataset.py: the server stops at start-up)."""

raise RuntimeError("batchd_broken refuses to import: its data volume is not mounted")
