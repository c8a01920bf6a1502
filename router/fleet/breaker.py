"""A circuit breaker per worker. Pure: the clock is injected.

    CLOSED    requests flow; ``failures`` consecutive failures open the circuit
    OPEN      no requests until ``cooldown_s`` has passed since it opened
    HALF_OPEN after the cool-down: one trial request at a time; its success closes the circuit,
              its failure opens it again for another cool-down

Contract: the dispatcher asks ``allows()`` (free, any number of times) while picking, then calls
``begin()`` once for the request it sends: True, and exactly one of ``success()``, ``failure()`` or
``cancel()`` follows when that request's outcome for this worker is known (``cancel``: no verdict,
e.g. the client left, another stage was to blame, or the stage was busy); False (the circuit
refuses now: it opened, or a half-open trial was taken, since the pick), and nothing changed: the
request goes elsewhere.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from enum import IntEnum


class State(IntEnum):
    CLOSED = 0
    HALF_OPEN = 1
    OPEN = 2


class CircuitBreaker:
    def __init__(self, failures: int, cooldown_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if failures <= 0 or cooldown_s <= 0:
            raise ValueError(f"a circuit breaker needs failures > 0 and cooldown_s > 0, got {failures}, {cooldown_s}")
        self.threshold = failures
        self.cooldown_s = cooldown_s
        self._clock = clock
        self._failures = 0  # consecutive
        self._opened_at: float | None = None
        self._trial = False  # a half-open trial request is in flight

    @property
    def state(self) -> State:
        if self._opened_at is None:
            return State.CLOSED
        if self._clock() - self._opened_at >= self.cooldown_s:
            return State.HALF_OPEN
        return State.OPEN

    def allows(self) -> bool:
        if self._opened_at is None:  # closed: the request path's case, without reading the clock
            return True
        return self.state is State.HALF_OPEN and not self._trial

    def begin(self) -> bool:
        """Take one request through the circuit if it allows one now (see the module's contract)."""
        if self._opened_at is None:
            return True
        if not self.allows():
            return False
        if self.state is State.HALF_OPEN:
            self._trial = True
        return True

    def success(self) -> None:
        self._failures = 0
        self._opened_at = None
        self._trial = False

    def failure(self) -> None:
        self._failures += 1
        if self._trial or self._failures >= self.threshold:
            self._opened_at = self._clock()
        self._trial = False

    def cancel(self) -> None:
        self._trial = False
