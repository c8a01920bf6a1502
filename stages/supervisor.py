"""Supervision of a server's long-lived background work: asyncio tasks and threads that must run
for the server's whole life (bootstrap receive loops, expiry loops, the engine thread, progress
threads).

Contract: the server owns one ``Supervisor``. Whoever starts a long-lived task starts it with
``spawn`` (or hands an existing one to ``watch``); whoever owns a long-lived thread registers a
liveness check with ``watch_thread``. A task that ends with an exception, or returns while the
server is not stopping, is a death: it is logged once with its traceback and ``failures()`` names
it from then on. ``/health`` answers 503 naming every failure, so an orchestrator restarts the
stage. ``stop()`` marks a deliberate shutdown: tasks cancelled or ended after it are not deaths.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine

log = logging.getLogger(__name__)


class Supervisor:
    def __init__(self) -> None:
        self._failures: dict[str, str] = {}
        self._threads: dict[str, Callable[[], bool]] = {}
        self._tasks: set[asyncio.Task] = set()
        self._children: dict[str, Supervisor] = {}
        self._stopping = False

    def spawn(self, name: str, coro: Coroutine) -> asyncio.Task:
        """Start ``coro`` as a supervised task named ``name`` (call from the event loop)."""
        return self.watch(name, asyncio.create_task(coro, name=name))

    def watch(self, name: str, task: asyncio.Task) -> asyncio.Task:
        """Supervise a task someone else created."""
        self._tasks.add(task)
        task.add_done_callback(lambda done: self._ended(name, done))
        return task

    def watch_thread(self, name: str, alive: Callable[[], bool]) -> None:
        """Report ``name`` as dead whenever ``alive()`` is False (checked on every ``failures()``)."""
        self._threads[name] = alive

    def adopt(self, name: str, child: Supervisor) -> None:
        """Report ``child``'s failures as this one's, each prefixed with ``name``, in place of the
        child adopted under ``name`` before (a part the server replaces while it runs, e.g. a
        switchable worker's role; its owner stops the old child)."""
        self._children[name] = child

    def fail(self, name: str, reason: str) -> None:
        """Record a death found some other way (e.g. a thread that reported its own crash)."""
        if name not in self._failures:
            log.error("%s died: %s", name, reason)
            self._failures[name] = reason

    def failures(self) -> dict[str, str]:
        """Every dead component -> why. Empty while the server is healthy."""
        for name, alive in self._threads.items():
            if not self._stopping and not alive():
                self._failures.setdefault(name, "thread is not running")
        failures = dict(self._failures)
        for prefix, child in self._children.items():
            failures.update({f"{prefix}: {name}": reason for name, reason in child.failures().items()})
        return failures

    async def stop(self) -> None:
        """Cancel every supervised task and wait for them; deaths after this are not reported."""
        self._stopping = True
        tasks = [task for task in self._tasks if not task.done()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _ended(self, name: str, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if self._stopping or task.cancelled():
            if not self._stopping:
                self.fail(name, "task was cancelled")
            return
        exc = task.exception()
        if exc is None:
            self.fail(name, "task returned")
            return
        log.error("%s died", name, exc_info=(type(exc), exc, exc.__traceback__))
        self._failures.setdefault(name, f"{type(exc).__name__}: {exc}")
