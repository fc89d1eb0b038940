"""Start ``batchd serve`` for an example: a free port, the server's log pumped, stopped on exit.

    with local_server(config_path, workers=2) as address:
        loader = batchd.RemoteDataLoader(address, ...)

``write_config`` writes a config for datasets and presets made by the example itself.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import queue
import re
import signal
import subprocess
import sys
import threading
import time


@contextlib.contextmanager
def local_server(config: pathlib.Path, workers: int | None, timeout: float = 120.0):
    """Run ``batchd serve --config config`` on a free port; yields its address, stops it on exit.
    Raises TimeoutError if it is not listening within ``timeout`` seconds, RuntimeError (with its
    log) if it exits first. ``BATCHD_VERBOSE=1`` echoes its log to stderr. In the main thread, a
    SIGTERM to this process exits it through here (SystemExit), so the server is stopped too."""
    cmd = [sys.executable, "-m", "batchd.cli", "serve", "--config", str(config), "--address", "127.0.0.1:0"]
    if workers:
        cmd += ["--workers", str(workers)]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:  # keep reading the server's log so it never blocks on a full pipe
        for line in proc.stderr:
            lines.put(line)
            if os.environ.get("BATCHD_VERBOSE"):
                sys.stderr.write("[server] " + line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    if threading.current_thread() is threading.main_thread():  # a SIGTERM to the example stops its server too
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        deadline, address, log = time.monotonic() + timeout, None, []
        while address is None:
            try:
                line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"the batchd server did not start within {timeout:g} s:\n{''.join(log)}") from None
            if line is None:
                raise RuntimeError(f"the batchd server exited with code {proc.wait()}:\n{''.join(log)}")
            log.append(line)
            m = re.search(r"listening on (\S+)", line)
            if m:
                address = m.group(1)
        print(f"batchd server (pid {proc.pid}) listening on {address}", file=sys.stderr)
        yield address
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def write_config(path: pathlib.Path, datasets: dict, pipelines: dict, workers: int = 2) -> pathlib.Path:
    """A server config at ``path`` (YAML): ``datasets`` and ``pipelines`` as the config's sections
    (pipelines as ``A.to_dict`` dicts)."""
    import yaml

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump({"address": "127.0.0.1:0", "workers": workers, "datasets": datasets,
                                    "pipelines": pipelines}, sort_keys=False))
    return path
