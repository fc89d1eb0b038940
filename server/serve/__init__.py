"""Batches to clients: computations and their reorder buffer (``computation.py``), a client's cursor
(``stream.py``), lending or copying slots (``transport.py``, ``leases.py``; the slots are ``server/shm/``'s), the gRPC adapter
(``service.py``), security, and live figures (``stats.py``, ``metrics.py``, ``lag.py``)."""
