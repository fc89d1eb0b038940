"""Samples into batches: pipelines and what clients may send (``pipeline.py``, ``prefix.py``, ``entropy.py``,
``allowlist*.py``), the worker process (``worker.py``, ``layout.py``, ``encoded.py``), the messages
between server and workers (``protocol.py``) and the pool that schedules them (``pool.py``,
``handles.py``)."""
