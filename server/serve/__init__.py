"""Batches to clients: computations and their reorder buffer (``computation.py``), a client's cursor
(``stream.py``), lending or copying (``transport.py``, ``shm.py``, ``leases.py``), the gRPC adapter
(``service.py``), security, and live figures (``stats.py``, ``metrics.py``, ``lag.py``)."""
