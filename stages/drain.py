"""A stage server's way out on SIGTERM (Kubernetes stops a pod so: SIGTERM, then SIGKILL after
``terminationGracePeriodSeconds``): stop taking work, finish what is in flight within a bound, abort
the rest, exit 0.

    SERVING --begin()--> DRAINING --(nothing in flight)--> done
                                  --(--shutdown-grace-s passed)--> EXPIRED --(the aborted ended)--> done

The state only moves forward. ``stages.api.drain_gate.DrainGate`` (the HTTP side) reads it: while
draining it answers ``/health`` with 503 ``{"status": "draining"}`` and refuses new work with 503
``draining``, and counts the work in flight (``enter`` / ``leave``); once expired it aborts that work
with an error. ``stages.server`` calls ``run`` on SIGTERM and stops the HTTP server when it returns.

Contract: one ``Drain`` per server process, used from its event loop only. Every ``enter`` is paired
with exactly one ``leave`` by the gate, however the request ends.
"""

from __future__ import annotations

import asyncio
import enum
import logging

log = logging.getLogger(__name__)
ABORT_WAIT_S = 5.0  # once expired: how long the aborted requests get to end (their cleanup frees their blocks)


class DrainState(enum.IntEnum):
    SERVING = 0
    DRAINING = 1
    EXPIRED = 2


class Drain:
    def __init__(self, grace_s: float) -> None:
        if not grace_s > 0:
            raise ValueError(f"--shutdown-grace-s must be > 0, got {grace_s}")
        self.grace_s = grace_s
        self.state = DrainState.SERVING
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._expired: asyncio.Future[None] | None = None

    @property
    def draining(self) -> bool:
        """True from ``begin`` on: new work is refused."""
        return self.state >= DrainState.DRAINING

    def enter(self) -> None:
        """A work request is admitted (the gate, only while serving)."""
        self.in_flight += 1
        self._idle.clear()

    def leave(self) -> None:
        """A work request's response has ended (sent whole, aborted, or its client left)."""
        if self.in_flight <= 0:
            raise RuntimeError("Drain.leave without a matching enter")
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()

    def expired(self) -> asyncio.Future[None]:
        """A future done once the grace has passed with work still in flight (shared: never cancel it)."""
        if self._expired is None:
            self._expired = asyncio.get_running_loop().create_future()
        return self._expired

    def begin(self) -> None:
        """Stop taking work (idempotent)."""
        self.state = max(self.state, DrainState.DRAINING)

    async def run(self) -> bool:
        """``begin``, then wait for the work in flight to end, at most ``grace_s``; past it, expire
        (the gate aborts what is left) and wait up to ``ABORT_WAIT_S`` for that to end. True when
        everything finished within the grace."""
        self.begin()
        log.info("draining: %d request(s) in flight, new ones refused; at most %g s (--shutdown-grace-s)",
                 self.in_flight, self.grace_s)
        try:
            await asyncio.wait_for(self._idle.wait(), self.grace_s)
            log.info("drained: every request in flight finished")
            return True
        except TimeoutError:
            pass
        log.warning("%d request(s) still running after %g s (--shutdown-grace-s): aborting them", self.in_flight,
                    self.grace_s)
        self.state = DrainState.EXPIRED
        expired = self.expired()
        if not expired.done():
            expired.set_result(None)
        try:
            await asyncio.wait_for(self._idle.wait(), ABORT_WAIT_S)
        except TimeoutError:
            log.error("%d aborted request(s) did not end within %g s", self.in_flight, ABORT_WAIT_S)
        return False
