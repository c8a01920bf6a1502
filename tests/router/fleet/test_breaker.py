"""The per-worker circuit breaker (router/fleet/breaker.py), on an injected clock."""

from __future__ import annotations

import pytest

from router.fleet.breaker import CircuitBreaker, State

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


def fail(breaker: CircuitBreaker, times: int) -> None:
    for _ in range(times):
        assert breaker.begin()
        breaker.failure()


def test_opens_after_n_consecutive_failures(clock):
    breaker = CircuitBreaker(3, 10.0, clock)
    fail(breaker, 2)
    assert breaker.state is State.CLOSED and breaker.allows()
    fail(breaker, 1)
    assert breaker.state is State.OPEN and not breaker.allows()
    assert breaker.begin() is False  # refused, and nothing changed
    clock.now += 10.0
    assert breaker.state is State.HALF_OPEN and breaker.begin()


def test_a_success_resets_the_count(clock):
    breaker = CircuitBreaker(3, 10.0, clock)
    fail(breaker, 2)
    breaker.begin()
    breaker.success()
    fail(breaker, 2)
    assert breaker.state is State.CLOSED


def test_half_open_after_the_cooldown_lets_one_trial_through(clock):
    breaker = CircuitBreaker(2, 10.0, clock)
    fail(breaker, 2)
    clock.now += 9.99
    assert breaker.state is State.OPEN
    clock.now += 0.01
    assert breaker.state is State.HALF_OPEN and breaker.allows()
    assert breaker.begin()
    assert not breaker.allows() and breaker.begin() is False  # one trial at a time
    breaker.success()
    assert breaker.state is State.CLOSED and breaker.allows()


def test_a_failed_trial_opens_it_again_for_a_full_cooldown(clock):
    breaker = CircuitBreaker(2, 10.0, clock)
    fail(breaker, 2)
    clock.now += 10.0
    fail(breaker, 1)  # one failure is enough in half-open
    assert breaker.state is State.OPEN
    clock.now += 9.0
    assert breaker.state is State.OPEN
    clock.now += 1.0
    assert breaker.state is State.HALF_OPEN


def test_a_cancelled_trial_frees_the_slot(clock):
    breaker = CircuitBreaker(1, 5.0, clock)
    fail(breaker, 1)
    clock.now += 5.0
    breaker.begin()
    breaker.cancel()
    assert breaker.state is State.HALF_OPEN and breaker.allows()


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="failures > 0"):
        CircuitBreaker(0, 1.0)
    with pytest.raises(ValueError, match="cooldown_s > 0"):
        CircuitBreaker(1, 0.0)
