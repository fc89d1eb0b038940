"""``batchd serve`` as a child process, ready once it logs ``listening on ADDRESS``.

One helper for the tests, the benchmarks and the examples, which start real servers::

    from batchd.server_process import ServerProcess, serve_command

    with ServerProcess(serve_command("--config", "server.yaml", "--address", "127.0.0.1:0")) as server:
        loader = batchd.RemoteDataLoader(server.address, "photos", batch_size=64)

``start()`` returns once the server logged ``listening on ADDRESS`` (logged when every worker is
ready): ``address`` is that address (the bound port, for ``127.0.0.1:0``). Its output (stderr and
stdout, merged) is read line by line on a thread for as long as it runs, so the server never
blocks on a full pipe; the last ``keep_lines`` lines are kept (``lines``, ``log``) and each line
is handed to ``on_line`` the moment it is read (e.g. to send a signal at exactly "listening on").
``stop()`` (and leaving the ``with``) terminates it and kills it if it has not exited within the
timeout. Standard library only: no server code is imported here.
"""

from __future__ import annotations

import collections
import os
import re
import signal
import subprocess
import sys
import threading
import time
from typing import Callable, Mapping, Sequence

from batchd import errors

LISTENING = re.compile(r"listening on (\S+)")


def serve_command(*args: str, python: str = sys.executable) -> list[str]:
    """``python -m batchd.cli serve ARGS...``: the server of this Python environment."""
    return [python, "-m", "batchd.cli", "serve", *map(str, args)]


class ServerExited(RuntimeError):
    """The server exited before it was listening. ``returncode`` (negative: killed by that
    signal) and ``log`` (its output) say why."""

    def __init__(self, returncode: int, log: str):
        self.returncode, self.log = returncode, log
        super().__init__(f"batchd serve exited with code {returncode} before listening; its log:\n{log}")


class ServerProcess:
    """``argv`` (a ``batchd serve`` command, e.g. ``serve_command(...)``) as a child process.

    env: its environment (default: this one's), with ``NO_ALBUMENTATIONS_UPDATE=1`` (no version
    check over the network) and ``PYTHONUNBUFFERED=1`` unless given. cwd: its working directory.
    timeout: seconds ``start()`` waits for "listening on". on_line: called with each line of
    its output (newline included) on the reading thread, before ``start()`` sees it.
    keep_lines: how many of the last lines ``lines`` keeps. new_session: start it in a session
    (and process group) of its own; ``kill()`` then kills the group, its workers included.

    Attributes: ``address`` (str, once listening), ``proc`` (the ``subprocess.Popen``), ``pid``,
    ``lines`` (the output's last lines, each with its newline), ``log`` (them as one str),
    ``startup_s`` (seconds from start to listening). ``start()`` may be called again once the
    process exited (a restart with the same command).
    """

    def __init__(self, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
                 cwd: str | os.PathLike | None = None, timeout: float = 120.0,
                 on_line: Callable[[str], None] | None = None, keep_lines: int = 2000, new_session: bool = False):
        self.argv = [str(a) for a in argv]
        self.env = {"NO_ALBUMENTATIONS_UPDATE": "1", "PYTHONUNBUFFERED": "1", **(os.environ if env is None else env)}
        self.cwd, self.timeout, self.on_line, self.new_session = cwd, timeout, on_line, new_session
        self.lines: collections.deque[str] = collections.deque(maxlen=keep_lines)
        self.address: str | None = None
        self.proc: subprocess.Popen | None = None
        self.startup_s: float | None = None
        self._listening = threading.Event()

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def start(self) -> "ServerProcess":
        """Start it and wait until it listens. Raises ``batchd.TimeoutError`` if it does not
        within ``timeout`` seconds (it is killed), ``ServerExited`` if it exits first; both carry
        its log."""
        self._listening.clear()
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, env=self.env, cwd=self.cwd,
                                     start_new_session=self.new_session)
        reader = threading.Thread(target=self._read, args=(self.proc,), name="batchd-serve-log", daemon=True)
        reader.start()
        deadline = time.monotonic() + self.timeout
        while not self._listening.wait(0.05):
            if self.proc.poll() is not None:
                reader.join(5.0)  # (its last lines may still be in the pipe)
                if not self._listening.is_set():
                    raise ServerExited(self.proc.returncode, self.log)
            if time.monotonic() > deadline:
                self.kill()
                raise errors.TimeoutError(f"batchd serve was not listening within {self.timeout:g} s; its log:\n"
                                          f"{self.log}")
        self.startup_s = time.perf_counter() - t0
        return self

    def _read(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            if self.on_line is not None:
                self.on_line(line)
            self.lines.append(line)
            if not self._listening.is_set():
                found = LISTENING.search(line)
                if found:
                    self.address = found.group(1)
                    self._listening.set()
        proc.stdout.close()

    def send_signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout: float | None = None) -> int:
        """Its exit code; raises ``subprocess.TimeoutExpired`` if it runs ``timeout`` seconds more."""
        return self.proc.wait(timeout)

    def stop(self, timeout: float = 20.0) -> int | None:
        """SIGTERM, then ``kill()`` if it has not exited within ``timeout`` seconds. Its exit code
        (None if it was never started). Idempotent."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL it (its process group, with ``new_session``) and reap it."""
        if self.proc is None or self.proc.poll() is not None:
            return
        if self.new_session:
            os.killpg(self.proc.pid, signal.SIGKILL)
        else:
            self.proc.kill()
        self.proc.wait(10)

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
