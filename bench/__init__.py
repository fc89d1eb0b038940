"""batchd's benchmark suite: ``python bench/run_all.py [--quick] [--only table1,table3,...]``.

Helpers, one idea per file: ``pipelines`` (L1-L4), ``data`` (the photo set and the manifests),
``server_proc`` (a ``batchd serve`` subprocess), ``sequential`` (the in-process baseline loop),
``torch_loader`` (the PyTorch DataLoader baseline), ``measure`` (timing and /proc accounting),
``machine`` (the results header), ``report`` (results.json -> results.md), ``chart`` (the PNG),
``fragments`` (results.json -> the pieces the docs include).
Each table is one ``table_*.py`` module with ``run(settings) -> dict``, ``render(result) -> str``
and ``targets(result) -> list``.
"""
