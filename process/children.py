"""Child processes: starting one as the leader of its own process group that dies with its starter,
and stopping one (SIGTERM, then SIGKILL), its whole group when it leads one.

Process rules of ``start_group``: the child leads its own process group, so a terminal's Ctrl-C
reaches only the starter, which stops its children in order; stopping signals the whole group, so
nothing a child forked survives it. On Linux the child gets SIGTERM from the kernel when the thread
that started it dies (``PR_SET_PDEATHSIG``, ``die_with_parent``: the embedded Redis of ``cache.embedded``
starts its server with it too), so a SIGKILLed starter orphans nothing.
Start such children from the thread that lives as long as they should.
"""

from __future__ import annotations

import ctypes
import functools
import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from typing import IO

_PR_SET_PDEATHSIG = 1


def start_group(argv: Sequence[str], log: IO[bytes], env: Mapping[str, str]) -> subprocess.Popen:
    """``argv`` started now, stdin closed, stdout and stderr to ``log``, as the leader of a new
    process group that gets SIGTERM when this thread dies (Linux)."""
    return subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=dict(env),
                            process_group=0, preexec_fn=functools.partial(die_with_parent, os.getpid())
                            if sys.platform == "linux" else None)


def stop_process(proc: subprocess.Popen, timeout_s: float = 10.0, group: bool = False) -> None:
    """SIGTERM ``proc``, SIGKILL it after ``timeout_s``, and reap it. ``group``: ``proc`` leads its own
    process group (``start_group``): both signals go to the whole group, and whatever is left in it
    afterwards (a grandchild that outlived its parent) gets SIGKILL too. Safe to call more than once."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if proc.poll() is not None:
            break
        if group:
            _signal_group(proc.pid, sig)
        else:
            proc.send_signal(sig)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            continue
    if group:
        _signal_group(proc.pid, signal.SIGKILL)
    proc.wait(timeout_s)


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):  # the group is empty (PermissionError: a zombie-only group)
        pass


def die_with_parent(parent_pid: int) -> None:
    """In the child, before exec (``preexec_fn``, Linux): SIGTERM me when the thread that forked me ends.
    ``start_group``'s children and the embedded Redis (``cache.embedded``) must not outlive a killed starter."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent_pid:  # the parent already died between fork and prctl
        os._exit(1)
