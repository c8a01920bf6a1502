"""Stopping a test's server process (SIGSTOP), the way the liveness and fault tests make a peer go
silent: its sockets stay open, nothing answers.

``os.kill(pid, SIGSTOP)`` returns while the signal is still pending: each thread stops only when it
next runs, so on a busy core a thread can still answer (a Mooncake handshake probe, an HTTP health
check) after the call. ``stop`` waits until every thread of the process is in the stopped state,
so what a test does next meets a stopped process.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager

STOP_DEADLINE_S = 10.0


def thread_state(stat_path: str) -> str:
    """The state letter of a /proc/PID/task/TID/stat ("T": stopped by a signal): the field after
    the parenthesised name, which may itself hold spaces or parentheses."""
    with open(stat_path) as stat:
        return stat.read().rpartition(")")[2].split()[0]


def stop(pid: int) -> None:
    """SIGSTOP ``pid`` and return once all of its threads have stopped (AssertionError after
    STOP_DEADLINE_S). A thread that exits meanwhile is not waited for."""
    os.kill(pid, signal.SIGSTOP)
    tasks = f"/proc/{pid}/task"
    deadline = time.monotonic() + STOP_DEADLINE_S
    while not all(_stopped_or_gone(f"{tasks}/{tid}/stat") for tid in os.listdir(tasks)):
        assert time.monotonic() < deadline, f"process {pid} did not stop within {STOP_DEADLINE_S} s of SIGSTOP"
        time.sleep(0.005)


def _stopped_or_gone(stat_path: str) -> bool:
    try:
        return thread_state(stat_path) in ("T", "t", "Z", "X")
    except FileNotFoundError:
        return True


@contextmanager
def stopped(pid: int) -> Iterator[None]:
    """The process is stopped for the block (``stop``), and continued (SIGCONT) when it ends."""
    stop(pid)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)
