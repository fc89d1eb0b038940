"""The benchmarks that need a GPU (CUDA): each a script, ``python -m bench.cuda.<name>``."""
