"""Pure helpers of transfer/ops.py and transfer/base.py: op coalescing, block ids to ops, range checks, config and
descriptor validation. No library, no I/O."""

from __future__ import annotations

import random

import msgspec
import pytest

from transfer.base import DESCRIPTOR_VERSION, RegionDescriptor, TransferConfig, TransferError, check_ops, decode_descriptor
from transfer.ops import WriteOp, block_ops, coalesce

pytestmark = pytest.mark.unit


def _bytes_map(ops: list[WriteOp]) -> dict[int, int]:
    """remote byte -> local byte, the meaning of a list of ops."""
    return {op.remote_offset + i: op.local_offset + i for op in ops for i in range(op.length)}


def test_coalesce_merges_runs_contiguous_on_both_sides():
    ops = [WriteOp(8, 108, 4), WriteOp(0, 100, 4), WriteOp(4, 104, 4)]
    assert coalesce(ops) == [WriteOp(0, 100, 12)]


def test_coalesce_keeps_ops_contiguous_on_one_side_only():
    local_only = [WriteOp(0, 100, 4), WriteOp(4, 200, 4)]
    remote_only = [WriteOp(0, 100, 4), WriteOp(50, 104, 4)]
    assert coalesce(local_only) == local_only
    assert coalesce(remote_only) == remote_only


def test_coalesce_edge_cases():
    assert coalesce([]) == []
    assert coalesce([WriteOp(3, 5, 7)]) == [WriteOp(3, 5, 7)]
    assert coalesce(iter([WriteOp(4, 4, 4), WriteOp(0, 0, 4)])) == [WriteOp(0, 0, 8)]  # any iterable
    # the same source read twice is allowed and not merged into one op
    assert coalesce([WriteOp(0, 0, 4), WriteOp(0, 8, 4)]) == [WriteOp(0, 0, 4), WriteOp(0, 8, 4)]


def test_coalesce_random_preserves_meaning():
    rng = random.Random(0)
    for _ in range(50):
        remote = rng.sample(range(64), 40)
        local = rng.sample(range(64), 40)
        runs = [WriteOp(lb * 16, rb * 16, 16) for lb, rb in zip(local, remote)]
        merged = coalesce(runs)
        assert _bytes_map(merged) == _bytes_map(runs)
        assert len(merged) <= len(runs)
        assert all(a.local_offset + a.length <= b.local_offset or
                   (a.local_offset + a.length, a.remote_offset + a.length) != (b.local_offset, b.remote_offset)
                   for a, b in zip(merged, merged[1:]))


def test_block_ops_contiguous_and_scattered():
    assert block_ops([0, 1, 2, 3], [10, 11, 12, 13], 100) == [WriteOp(0, 1000, 400)]
    assert block_ops([0, 1, 5, 6, 9], [2, 3, 7, 8, 0], 10) == [
        WriteOp(0, 20, 20), WriteOp(50, 70, 20), WriteOp(90, 0, 10)]
    # contiguous locally but reversed remotely: no merge
    assert block_ops([0, 1], [1, 0], 8) == [WriteOp(0, 8, 8), WriteOp(8, 0, 8)]
    # unsorted input is sorted by local offset first
    assert block_ops([3, 2, 1], [6, 5, 4], 1) == [WriteOp(1, 4, 3)]
    assert block_ops([], [], 64) == []


def test_block_ops_scales():
    n = 200_000
    assert block_ops(list(range(n)), list(range(1, n + 1)), 4096) == [WriteOp(0, 4096, n * 4096)]


@pytest.mark.parametrize("local, remote, block_bytes, match", [
    ([0, 1], [0], 8, "2 local blocks but 1 remote"),
    ([0], [0], 0, "block_bytes"),
    ([-1], [0], 8, ">= 0"),
    ([0], [-3], 8, ">= 0"),
    ([0, 1], [4, 4], 8, "appears twice"),
])
def test_block_ops_rejects(local, remote, block_bytes, match):
    with pytest.raises(ValueError, match=match):
        block_ops(local, remote, block_bytes)


@pytest.mark.parametrize("args", [(-1, 0, 1), (0, -1, 1), (0, 0, 0), (0, 0, -5)])
def test_write_op_rejects_negative_or_empty(args):
    with pytest.raises(ValueError):
        WriteOp(*args)


def test_check_ops_bounds():
    check_ops([WriteOp(0, 0, 100), WriteOp(100, 50, 50)], local_length=200, remote_length=100)
    with pytest.raises(TransferError, match="local region"):
        check_ops([WriteOp(150, 0, 51)], local_length=200, remote_length=1000)
    with pytest.raises(TransferError, match="remote region"):
        check_ops([WriteOp(0, 60, 41)], local_length=200, remote_length=100)


@pytest.mark.parametrize("kwargs, match", [
    ({"host": ""}, "host"),
    ({"host": "bad host"}, "host"),
    ({"host": "0.0.0.0"}, "wildcard"),
    ({"host": "::"}, "wildcard"),
    ({"protocol": "udp"}, "protocol"),
    ({"device": "mlx5_0 mlx5_1"}, "device"),
    ({"timeout_s": 0}, "timeout_s"),
    ({"timeout_s": -1.0}, "timeout_s"),
])
def test_config_fails_fast(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TransferConfig(**kwargs)


def test_config_accepts_hosts():
    for host in ("127.0.0.1", "::1", "10.1.2.3", "localhost", "decode-0.svc.cluster.local"):
        assert TransferConfig(host=host).host == host


class _Desc(RegionDescriptor, frozen=True, kw_only=True):
    extra: str


def test_descriptor_round_trip_and_refusals():
    desc = _Desc(backend="a", version=DESCRIPTOR_VERSION, base=4096, length=64, extra="x")
    data = msgspec.msgpack.encode(desc)
    assert decode_descriptor(data, "a", _Desc) == desc
    with pytest.raises(TransferError, match="'a' transfer backend but this process uses 'b'"):
        decode_descriptor(data, "b", _Desc)
    old = msgspec.msgpack.encode(_Desc(backend="a", version=0, base=4096, length=64, extra="x"))
    with pytest.raises(TransferError, match="version"):
        decode_descriptor(old, "a", _Desc)
    empty = msgspec.msgpack.encode(_Desc(backend="a", version=DESCRIPTOR_VERSION, base=0, length=0, extra=""))
    with pytest.raises(TransferError, match="no registered region"):
        decode_descriptor(empty, "a", _Desc)
    for garbage in (b"", b"\x00pool", msgspec.msgpack.encode([1, 2]),
                    msgspec.msgpack.encode({"backend": "a", "version": DESCRIPTOR_VERSION})):
        with pytest.raises(TransferError, match="malformed"):
            decode_descriptor(garbage, "a", _Desc)
