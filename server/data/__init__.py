"""Where samples come from: dataset kinds and their storage (``datasets/``), a worker's concurrent
reads (``reader.py``) and the decoded-sample cache (``cache/``)."""
