"""``stage up`` as a subprocess for the tests that run one (tests/stages/launch/test_stage_up.py, the
secrets and Prometheus tests): ``Up`` collects its stdout lines on a reader thread and reads the
children it started from them; ``cmdlines()`` is every process's command line, from /proc."""

from __future__ import annotations

import os
import queue
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

from stages.config import TOKEN_ENV

REPO = Path(__file__).resolve().parents[2]
STARTED = re.compile(r"^stage up: started (\w+) at http://127\.0\.0\.1:(\d+) \(pid (\d+), log (.+)\)$")


class Up:
    """``stage up`` as a subprocess; its stdout lines are collected by a reader thread."""

    def __init__(self, *flags: str, log_dir: Path) -> None:
        self.log_dir = log_dir
        env = {key: value for key, value in os.environ.items() if key != TOKEN_ENV}  # the token: --admin-token only
        self.proc = subprocess.Popen([sys.executable, "-m", "cli", "up", *flags, "--log-dir", str(log_dir)],
                                     cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env={**env, "PYTHONUNBUFFERED": "1"})
        self.lines: list[str] = []
        self._new: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._new.put(line.rstrip("\n"))
        self._new.put(None)

    def wait_line(self, prefix: str, within_s: float) -> str:
        deadline = time.monotonic() + within_s
        while True:
            try:
                line = self._new.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no {prefix!r} line within {within_s} s; so far: {self.lines}") from None
            if line is None:
                raise AssertionError(f"stage up ended (code {self.proc.wait(5)}) before {prefix!r}: {self.lines}\n"
                                     f"{self.proc.stderr.read()}")
            self.lines.append(line)
            if line.startswith(prefix):
                return line

    def children(self) -> dict[str, tuple[int, int]]:
        """role -> (port, pid), from the 'started' lines."""
        return {m[1]: (int(m[2]), int(m[3])) for m in map(STARTED.match, self.lines) if m}

    def finish(self, within_s: float) -> tuple[int, str]:
        code = self.proc.wait(within_s)
        rest = self._new.get(timeout=5)
        while rest is not None:
            self.lines.append(rest)
            rest = self._new.get(timeout=5)
        return code, self.proc.stderr.read()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def cmdlines() -> dict[int, list[str]]:
    out = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                out[int(entry.name)] = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
            except OSError:  # ended meanwhile
                pass
    return out
