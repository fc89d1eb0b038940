"""Start ``batchd serve`` for an example (``batchd.server_process``): a free port, stopped on exit.

    with local_server(config_path, workers=2) as address:
        loader = batchd.RemoteDataLoader(address, ...)

``write_config`` writes a config for datasets and presets made by the example itself.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import signal
import sys
import threading

from batchd.server_process import ServerProcess, serve_command


@contextlib.contextmanager
def local_server(config: pathlib.Path, workers: int | None, timeout: float = 120.0):
    """Run ``batchd serve --config config`` on a free port; yields its address, stops it on exit.
    Raises TimeoutError if it is not listening within ``timeout`` seconds, RuntimeError (with its
    log) if it exits first. ``BATCHD_VERBOSE=1`` echoes its log to stderr. In the main thread, a
    SIGTERM to this process exits it through here (SystemExit), so the server is stopped too."""
    args = ["--config", config, "--address", "127.0.0.1:0"] + (["--workers", str(workers)] if workers else [])
    echo = (lambda line: sys.stderr.write("[server] " + line)) if os.environ.get("BATCHD_VERBOSE") else None
    if threading.current_thread() is threading.main_thread():  # a SIGTERM to the example stops its server too
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    server = ServerProcess(serve_command(*args), timeout=timeout, on_line=echo).start()
    try:
        print(f"batchd server (pid {server.pid}) listening on {server.address}", file=sys.stderr)
        yield server.address
    finally:
        server.stop(30)


def write_config(path: pathlib.Path, datasets: dict, pipelines: dict, workers: int = 2) -> pathlib.Path:
    """A server config at ``path`` (YAML): ``datasets`` and ``pipelines`` as the config's sections
    (pipelines as ``A.to_dict`` dicts)."""
    import yaml

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump({"address": "127.0.0.1:0", "workers": workers, "datasets": datasets,
                                    "pipelines": pipelines}, sort_keys=False))
    return path
