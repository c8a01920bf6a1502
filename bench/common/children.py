"""Child processes of a benchmark: ``Child`` (any command, pinned before it execs, its output in a
log, a health wait) and ``Server`` (``stage serve <role>`` on a free loopback port)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from bench.common.proc import thread_cpu, tree_cpu_seconds, tree_run_seconds
from stages.launch.health import wait_healthy
from process.ports import free_port
from process.children import stop_process

REPO = Path(__file__).resolve().parents[2]
LOG_TAIL = 3000  # characters of a child's log shown when it fails to start


class Child:
    """``argv`` started now in the repo root, stdin closed, stdout and stderr to ``log_path``, pinned
    to ``cores`` before exec (every thread it makes inherits them; empty: not pinned). ``url`` is
    where it answers HTTP (``wait`` polls its ``/health``)."""

    def __init__(self, name: str, argv: Sequence[str], cores: Sequence[int], log_path: Path, url: str = "",
                 env: Mapping[str, str] | None = None) -> None:
        self.name, self.argv, self.cores, self.log_path, self.url = name, list(argv), list(cores), log_path, url
        pinned = self.cores
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         cwd=REPO, env=dict(env if env is not None else os.environ),
                                         preexec_fn=(lambda: os.sched_setaffinity(0, pinned)) if pinned else None)

    def wait(self, timeout_s: float) -> None:
        """Until ``url``/health answers 200; RuntimeError naming the child, with the end of its log,
        if it exits first or is not healthy within ``timeout_s``."""
        try:
            wait_healthy(self.url, self.proc, timeout_s)
        except (RuntimeError, TimeoutError) as exc:
            tail = self.log_path.read_text(errors="replace")[-LOG_TAIL:]
            raise RuntimeError(f"{self.name}: {str(exc) or 'not healthy'} (within {timeout_s:g} s); log:\n{tail}") from None

    def cpu(self, precise: bool = False) -> float:
        """CPU seconds of the child and its live descendants so far; ``precise``: of their live threads,
        in the scheduler's nanoseconds (``tree_run_seconds``), not 10 ms ticks."""
        return (tree_run_seconds if precise else tree_cpu_seconds)(self.proc.pid)

    def threads(self, top: int = 8) -> list[list]:
        """Its busiest threads: [name, CPU seconds]."""
        return thread_cpu(self.proc.pid, top)

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout_s``."""
        stop_process(self.proc, timeout_s)


class Server(Child):
    """``stage serve <role>`` on a free loopback port with ``threads`` torch threads (on ``device``,
    its ``--device``), pinned to ``cores``, logging to ``log_path``. ``extra_env``: KEY=VALUE items
    for its environment; PYTHONPATH=DIR is prepended (e.g. a scratch copy of the engine to A/B)."""

    def __init__(self, role: str, model: Path, cores: Sequence[int], threads: int, log_path: Path,
                 flags: Sequence[str] = (), extra_env: Sequence[str] = (), device: str = "cpu") -> None:
        self.role, port = role, free_port()
        argv = [sys.executable, "-m", "cli", "serve", role, "--model", str(model), "--port", str(port),
                "--threads", str(threads), "--device", device, "--log-level", "warning", *flags]
        super().__init__(f"{role} server", argv, cores, log_path, f"http://127.0.0.1:{port}",
                         server_env(threads, extra_env))


def server_env(threads: int, extra_env: Sequence[str] = ()) -> dict[str, str]:
    """This process's environment with ``threads`` OpenMP/MKL threads, unbuffered output, the repo on
    PYTHONPATH, and each KEY=VALUE of ``extra_env`` (PYTHONPATH values prepended)."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    for item in extra_env:
        key, _, value = item.partition("=")
        env[key] = os.pathsep.join([value, env[key]]) if key == "PYTHONPATH" else value
    return env
