"""``FaultyBackend`` (``prefill.fail_kv_write``): the real backend's behaviour, but an armed write
fails as a TransferError with nothing written, counted as a failed write. Over the in-memory fake;
over Mooncake for real in tests/stages/disagg/test_pd_faults.py."""

from __future__ import annotations

import numpy as np
import pytest

from stages.faults.points import Fault, Faults
from stages.faults.transfer import FaultyBackend
from tests.support.transfer_fakes import FakeBackend
from transfer.base import TransferError
from transfer.ops import WriteOp

pytestmark = pytest.mark.unit

SIZE = 4096


@pytest.fixture
def pair():
    """A wrapped initiator over a fake, and a fake target, each with its region."""
    faults = Faults()
    inner, target = FakeBackend(), FakeBackend()
    initiator = FaultyBackend(inner, faults)
    src, dst = np.arange(SIZE, dtype=np.uint8), np.zeros(SIZE, np.uint8)
    initiator.register(src.ctypes.data, SIZE)
    target.register(dst.ctypes.data, SIZE)
    yield faults, inner, initiator, target, dst
    initiator.release()
    target.release()


def test_it_is_the_inner_backend_unless_armed(pair):
    faults, inner, initiator, target, dst = pair
    assert (initiator.name, initiator.descriptor(), initiator.config) == (inner.name, inner.descriptor(), inner.config)
    peer = initiator.connect(target.descriptor())
    assert peer is initiator.connect(target.descriptor()) and peer is inner.connect(target.descriptor())
    assert initiator.write(peer, [WriteOp(0, 100, 50)]) == 50
    assert np.array_equal(dst[100:150], np.arange(50, dtype=np.uint8)) and not dst[150:].any()
    assert inner.writes == [(peer.key, [WriteOp(0, 100, 50)])]
    assert (initiator.stats.writes, initiator.stats.failures, initiator.threads_alive()) == (1, 0, True)


def test_an_armed_write_fails_with_nothing_written_and_counts(pair):
    faults, inner, initiator, target, dst = pair
    peer = initiator.connect(target.descriptor())
    faults.arm(Fault("prefill.fail_kv_write"))
    with pytest.raises(TransferError, match="^fault point prefill.fail_kv_write: the write was dropped") as caught:
        initiator.write(peer, [WriteOp(0, 0, SIZE)])
    assert not caught.value.in_flight
    assert not dst.any() and inner.writes == []
    assert (initiator.stats.writes, initiator.stats.failures) == (0, 1)
    assert faults.armed() == []  # one use: the next write goes through
    assert initiator.write(peer, [WriteOp(0, 0, SIZE)]) == SIZE and dst[SIZE - 1] == (SIZE - 1) % 256


def test_release_releases_the_inner_backend(pair):
    faults, inner, initiator, target, dst = pair
    initiator.release()
    with pytest.raises(TransferError, match="released"):
        inner.descriptor()
