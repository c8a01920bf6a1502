"""Stage servers forked from one pre-imported interpreter, instead of each started from scratch.

Every ``stage serve ROLE`` a test starts (``tests.conftest.launch``) used to be a fresh
``python -m cli serve ...``: some 5 s of CPU each, nearly all of it importing torch and
transformers, paid a few hundred times a run. Here one ``multiprocessing`` forkserver per test
process imports those modules once (``PRELOAD``), and each server is a fork of it that runs
``cli.main(argv)``, the ``stage`` command's own entry point: its own process and process id,
its own sockets, its own log file, this test process's environment at the time of the call. The
forkserver only imports: it runs no torch op and starts no thread (each fork checks that its parent
has one thread, and exits 70 with the reason in its log if not), so a fork is what a fresh interpreter
is after those imports. Module state drawn at import would be
shared by every fork; there is none (``process.instance.instance_id`` is drawn per process).

The router is not forked (``forked(role)``): it imports neither torch nor transformers, so a fresh
one starts in well under a second, and a fork would carry those modules in its memory, which the
router's memory tests measure. Each fork freezes what it inherited (``gc.freeze``) before it runs,
so a full garbage collection in it (the router's, or any server's) does not walk, and copy, every
inherited page.

``start(argv, log_path, env, netns=None) -> ForkedProcess``: the server runs in the background;
``ForkedProcess`` has the part of ``subprocess.Popen`` the tests use. ``netns``: the name of a network
namespace (``/var/run/netns/<name>``, ``ip netns add``) the fork enters before anything else, so
every socket it opens is that namespace's (the multi-host rig, ``tests/multihost/rig.py``). ``EPD_TEST_FRESH_SERVERS=1`` makes
``tests.conftest.launch`` start fresh interpreters instead, to rule the fork out.
"""

from __future__ import annotations

import atexit
import ctypes
import gc
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

FRESH_ENV = "EPD_TEST_FRESH_SERVERS"
REPO = Path(__file__).resolve().parents[2]
# what the roles import before they serve: the CLI, each role's app and engine, torch and
# transformers with the model families the tests generate (not Mooncake or NIXL: their native
# libraries may start threads at import; each server imports them itself)
PRELOAD = [
    "tests.support.server_forks",
    "cli", "cli.serve", "stages.server",
    "stages.colocated", "stages.disagg.server", "stages.disagg.switchable", "stages.encoder.server",
    "stages.api.routes", "stages.engine.engine", "stages.loading",
    "transformers.models.qwen2_vl.modeling_qwen2_vl", "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl",
    "transformers.models.qwen3_vl.modeling_qwen3_vl", "transformers.models.llava.modeling_llava",
    "transformers.models.clip.modeling_clip", "transformers.models.siglip.modeling_siglip",
    "transformers.models.llama.modeling_llama", "transformers.models.qwen2.modeling_qwen2",
]

CLONE_NEWNET = 0x40000000
NETNS_DIR = Path("/var/run/netns")

_context_lock = threading.Lock()
_context: multiprocessing.context.ForkServerContext | None = None


def fresh_interpreters() -> bool:
    """True when servers are to be started as fresh interpreters (``EPD_TEST_FRESH_SERVERS=1``)."""
    return os.environ.get(FRESH_ENV, "") not in ("", "0")


def forked(role: str) -> bool:
    """Whether ``tests.conftest.launch`` forks a ``role`` server (else: a fresh interpreter)."""
    return role != "router" and not fresh_interpreters()


class ForkedProcess:
    """A forked server, seen through the part of ``subprocess.Popen`` the tests use: ``pid``,
    ``poll()``, ``wait(timeout)``, ``returncode``, ``send_signal``, ``terminate``, ``kill``. Exit codes
    read as Popen's: the status the server exited with, or minus the signal that ended it. Only
    the process that called ``start`` may wait on it."""

    def __init__(self, process: multiprocessing.process.BaseProcess, args: Sequence[str]) -> None:
        self._process = process
        self.args = list(args)
        self.pid = process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        code = self._process.exitcode
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:  # it ended (and was reaped) since poll(): as Popen.send_signal, nothing to do
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def start(argv: Sequence[str], log_path: Path, env: Mapping[str, str], netns: str | None = None) -> ForkedProcess:
    """Fork ``stage ARGV`` off the pre-imported interpreter, with ``env`` as its whole environment,
    stdout and stderr to ``log_path`` (truncated), the repository as its working directory, and, if
    ``netns`` is given, inside that network namespace (entered first thing; the fork exits 71 with
    the reason in its log if it cannot). Returns at once; the caller waits for health and stops it
    (``process.children.stop_process``)."""
    process = _forkserver().Process(target=_run, args=(list(argv), str(log_path), dict(env), netns), daemon=False)
    process.start()
    return ForkedProcess(process, ["stage", *argv])


def enter_netns(name: str) -> None:
    """Move the calling thread into network namespace ``name`` (``/var/run/netns/<name>``) with
    setns(2): sockets it opens from now on, and threads it starts, are that namespace's. Needs
    CAP_SYS_ADMIN; raises OSError naming the namespace otherwise."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(NETNS_DIR / name, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"setns into network namespace {name}: {os.strerror(errno)}")
    finally:
        os.close(fd)


def _forkserver() -> multiprocessing.context.ForkServerContext:
    global _context
    with _context_lock:
        if _context is None:
            context = multiprocessing.get_context("forkserver")
            context.set_forkserver_preload(PRELOAD)
            _context = context
        return _context


def _run(argv: list[str], log_path: str, env: dict[str, str], netns: str | None = None) -> None:
    """In the fork: enter ``netns`` if given, become what ``stage ARGV`` would be (environment,
    working directory, argv, stdout and stderr on the log, line-buffered), die with the forkserver,
    run the command, and leave as an interpreter does (atexit handlers; multiprocessing's children
    skip them)."""
    gc.freeze()  # before anything here allocates: what the forkserver imported is never walked again
    netns_error = None
    if netns is not None:  # the fork has one thread (checked below): all it will open is the namespace's
        try:
            enter_netns(netns)
        except OSError as exc:
            netns_error = str(exc)
    from process.children import die_with_parent

    forkserver = os.getppid()
    die_with_parent(forkserver)
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    threads = len(os.listdir(f"/proc/{forkserver}/task"))
    if threads != 1:  # a thread of a library (an OpenMP pool) is not in the fork: its state would be broken
        print(f"tests.support.server_forks: the forkserver has {threads} threads after its imports; "
              f"set {FRESH_ENV}=1 and find the import that starts one", file=sys.stderr)
        os._exit(70)
    if netns_error is not None:
        print(f"tests.support.server_forks: {netns_error}", file=sys.stderr)
        os._exit(71)
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    sys.stderr.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    os.environ.clear()
    os.environ.update(env)
    os.chdir(REPO)
    sys.argv = ["stage", *argv]
    from cli import main

    try:
        code = main(argv)
    finally:
        atexit._run_exitfuncs()
    sys.exit(code)
