"""``transfer.mooncake_handshake.Handshakes``: a peer is probed before its first write and after a
failed one, one probe per peer at a time, and nobody waits on a probe past their deadline. The probe
is a plain callable and the runner the real worker pool (no library calls)."""

from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("mooncake.engine")
from transfer.base import TransferError  # noqa: E402
from transfer.mooncake import _WorkerPool  # noqa: E402
from transfer.mooncake_handshake import Handshakes  # noqa: E402

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]
SLACK_S = 0.5


class Peers:
    """A probe answering ``rc`` per key (0 unless set), stalling for a key in ``stalled`` until
    ``answer(key)``; counts calls."""

    def __init__(self) -> None:
        self.rc: dict[str, int] = {}
        self.calls: dict[str, int] = {}
        self.stalled: dict[str, threading.Event] = {}

    def stall(self, key: str) -> None:
        self.stalled[key] = threading.Event()

    def answer(self, key: str) -> None:
        self.stalled[key].set()

    def probe(self, key: str) -> int:
        self.calls[key] = self.calls.get(key, 0) + 1
        if key in self.stalled:
            self.stalled[key].wait(30)
        return self.rc.get(key, 0)


@pytest.fixture
def pool():
    pool = _WorkerPool()
    yield pool
    pool.stop()


@pytest.fixture
def peers() -> Peers:
    return Peers()


@pytest.fixture
def handshakes(peers, pool) -> Handshakes:
    return Handshakes(peers.probe, pool.call)


def soon(seconds: float = 5.0) -> float:
    return time.monotonic() + seconds


def test_a_peer_that_answered_is_not_probed_again_until_a_write_fails(handshakes, peers):
    handshakes.ensure("a", soon())
    handshakes.ensure("a", soon())
    assert peers.calls == {"a": 1}
    handshakes.failed("a")
    handshakes.ensure("a", soon())
    assert peers.calls == {"a": 2}


def test_a_failed_probe_raises_its_code_and_the_next_write_probes_afresh(handshakes, peers):
    peers.rc["dead"] = -102
    for calls in (1, 2):
        with pytest.raises(TransferError, match="handshake probe of dead failed with code -102"):
            handshakes.ensure("dead", soon())
        assert peers.calls["dead"] == calls


def test_a_stalled_peer_gets_one_probe_and_every_writer_fails_at_its_own_deadline(handshakes, peers, pool):
    peers.stall("stalled")
    started = time.monotonic()
    with pytest.raises(TransferError, match="handshake probe of stalled did not finish in time"):
        handshakes.ensure("stalled", time.monotonic() + 0.3)
    assert 0.3 <= time.monotonic() - started < 0.3 + SLACK_S
    for _ in range(3):  # later writers wait on the same probe: no new thread each
        started = time.monotonic()
        with pytest.raises(TransferError, match="stalled has not answered a handshake probe in time"):
            handshakes.ensure("stalled", time.monotonic() + 0.2)
        assert 0.2 <= time.monotonic() - started < 0.2 + SLACK_S
    assert peers.calls == {"stalled": 1} and pool.wait_idle(0) == 1
    handshakes.ensure("live", soon())  # other peers are probed meanwhile
    peers.answer("stalled")  # the peer answers after all: the next writer goes through without a new probe
    assert pool.wait_idle(5) == 0
    handshakes.ensure("stalled", soon())
    assert peers.calls == {"stalled": 1, "live": 1}


def test_concurrent_first_writes_share_one_probe(handshakes, peers):
    peers.stall("a")
    errors: list[BaseException] = []

    def first_write() -> None:
        try:
            handshakes.ensure("a", soon())
        except BaseException as error:  # handed to the assertion below
            errors.append(error)

    writers = [threading.Thread(target=first_write) for _ in range(4)]
    for writer in writers:
        writer.start()
    time.sleep(0.1)
    peers.answer("a")
    for writer in writers:
        writer.join(5)
    assert errors == [] and peers.calls == {"a": 1}
