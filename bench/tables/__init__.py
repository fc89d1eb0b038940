"""The numbered tables: one module per table, ``run(settings)``, ``render(result)``, ``targets(result)``
(``bench.run_all`` keeps the registry).
"""
