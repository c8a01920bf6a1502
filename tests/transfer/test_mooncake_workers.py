"""The Mooncake backend's worker pool (``transfer.mooncake._WorkerPool``): a bounded set of reused
threads, callers never wait past their deadline, and abandoned calls make new calls fail fast
instead of piling up. Plain Python callables stand in for the library call (the pool is the unit)."""

from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("mooncake.engine")
from transfer.base import TransferError  # noqa: E402
from transfer.mooncake import MAX_ABANDONED, WORKERS, _WorkerPool  # noqa: E402

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]
SLACK_S = 0.5


def workers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("mooncake-worker-")]


@pytest.fixture
def pool():
    pool = _WorkerPool()
    yield pool
    pool.stop()


def soon(seconds: float = 5.0) -> float:
    return time.monotonic() + seconds


def test_calls_reuse_a_bounded_set_of_threads(pool):
    before = set(workers())
    assert [pool.call(lambda i=i: i * 2, soon(), "double") for i in range(200)] == [2 * i for i in range(200)]
    assert len(set(workers()) - before) == 1  # one caller at a time: one thread, reused

    gate = threading.Barrier(WORKERS + 1)
    threads = [threading.Thread(target=pool.call, args=(lambda: gate.wait(5), soon(), "meet")) for _ in range(WORKERS)]
    for t in threads:
        t.start()
    gate.wait(5)  # all WORKERS calls run at once
    for t in threads:
        t.join(5)
    assert len(set(workers()) - before) == WORKERS
    assert pool.wait_idle(5) == 0 and pool.alive()


def test_an_error_in_the_call_reaches_the_caller(pool):
    def fail() -> None:
        raise OSError("segment handshake refused")

    with pytest.raises(TransferError, match="open peer raised OSError") as info:
        pool.call(fail, soon(), "open peer")
    assert isinstance(info.value.__cause__, OSError) and not info.value.in_flight
    assert pool.call(lambda: "ok", soon(), "after") == "ok"


def test_a_late_call_is_abandoned_at_its_deadline_and_keeps_its_worker(pool):
    release = threading.Event()
    started = time.monotonic()
    with pytest.raises(TransferError, match="did not finish in time") as info:
        pool.call(lambda: release.wait(30), time.monotonic() + 0.3, "stuck write")
    assert info.value.in_flight
    assert 0.3 <= time.monotonic() - started < 0.3 + SLACK_S
    assert pool.wait_idle(0.1) == 1  # still running on its worker
    release.set()
    assert pool.wait_idle(5) == 0


def test_abandoned_calls_leave_the_workers_to_the_others(pool):
    """A stalled peer holds the threads of its abandoned writes, not the writes to other peers."""
    release = threading.Event()
    for i in range(WORKERS):
        with pytest.raises(TransferError, match="did not finish in time"):
            pool.call(lambda: release.wait(30), time.monotonic() + 0.05, f"stuck write {i}")
    gate = threading.Barrier(WORKERS + 1)
    threads = [threading.Thread(target=pool.call, args=(lambda: gate.wait(5), soon(), "healthy")) for _ in range(WORKERS)]
    for t in threads:
        t.start()
    gate.wait(5)  # WORKERS live calls run at once beside the abandoned ones
    for t in threads:
        t.join(5)
    assert pool.call(lambda: "ok", soon(), "another peer") == "ok"
    release.set()
    assert pool.wait_idle(5) == 0


def test_max_abandoned_calls_fail_new_calls_at_once(pool):
    release = threading.Event()
    for i in range(MAX_ABANDONED):
        with pytest.raises(TransferError, match="did not finish in time"):
            pool.call(lambda: release.wait(30), time.monotonic() + 0.05, f"stuck write {i}")
    started = time.monotonic()
    with pytest.raises(TransferError, match=f"{MAX_ABANDONED} mooncake worker threads are held by abandoned calls") as info:
        pool.call(lambda: "never runs", soon(10), "new write")
    assert time.monotonic() - started < 0.1 and not info.value.in_flight
    release.set()
    assert pool.wait_idle(5) == 0
    assert pool.call(lambda: "runs again", soon(), "later write") == "runs again"
    assert pool.alive()


def test_busy_workers_make_a_call_wait_only_until_its_deadline(pool):
    release = threading.Event()
    busy = [threading.Thread(target=pool.call, args=(lambda: release.wait(30), soon(30), "long write"))
            for _ in range(WORKERS)]
    for t in busy:
        t.start()
    deadline = time.monotonic() + 0.3
    while pool.wait_idle(0) < WORKERS:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    started = time.monotonic()
    with pytest.raises(TransferError, match="no mooncake worker became free in time") as info:
        pool.call(lambda: "never runs", time.monotonic() + 0.3, "queued write")
    assert 0.3 <= time.monotonic() - started < 0.3 + SLACK_S and not info.value.in_flight
    results: list[str] = []
    waiting = threading.Thread(target=lambda: results.append(pool.call(lambda: "ran", soon(), "patient write")))
    waiting.start()
    time.sleep(0.1)
    release.set()  # the long writes end; the waiting call gets a worker
    waiting.join(5)
    for t in busy:
        t.join(5)
    assert results == ["ran"]


def test_stop_refuses_new_calls_and_ends_the_threads():
    pool = _WorkerPool()
    before = set(workers())
    assert pool.call(lambda: 1, soon(), "one") == 1
    mine = set(workers()) - before
    assert len(mine) == 1
    pool.stop()
    with pytest.raises(TransferError, match="released"):
        pool.call(lambda: 2, soon(), "two")
    for t in mine:
        t.join(5)
        assert not t.is_alive()
    assert pool.alive()  # a deliberate stop is not a death
