"""Write ops: byte ranges to copy from a local registered region into a remote one, and turning a
request's block ids into the fewest of them (contiguous runs on both sides merged). Pure: no I/O.

    block_ops([4, 5, 9], [0, 1, 2], block_bytes) -> [WriteOp(4b, 0, 2b), WriteOp(9b, 2b, b)]
    coalesce(ops) -> the same bytes in the fewest ops
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class WriteOp:
    """Copy ``length`` bytes from local region offset ``local_offset`` to remote ``remote_offset``."""

    local_offset: int
    remote_offset: int
    length: int

    def __post_init__(self) -> None:
        if self.local_offset < 0 or self.remote_offset < 0 or self.length <= 0:
            raise ValueError(f"{self}: offsets must be >= 0 and length > 0")


def coalesce(ops: Iterable[WriteOp]) -> list[WriteOp]:
    """Merge ops that are contiguous on both sides, after sorting by local offset. O(n log n)."""
    return _merge(sorted((op.local_offset, op.remote_offset, op.length) for op in ops))


def block_ops(local_blocks: Sequence[int], remote_blocks: Sequence[int], block_bytes: int) -> list[WriteOp]:
    """Ops that copy local block ``local_blocks[i]`` into remote block ``remote_blocks[i]`` for every i,
    coalesced (block b of a region starts at offset ``b * block_bytes``)."""
    if len(local_blocks) != len(remote_blocks):
        raise ValueError(f"block_ops: {len(local_blocks)} local blocks but {len(remote_blocks)} remote blocks")
    if block_bytes <= 0:
        raise ValueError(f"block_ops: block_bytes must be > 0, got {block_bytes}")
    if min(local_blocks, default=0) < 0 or min(remote_blocks, default=0) < 0:
        raise ValueError("block_ops: block ids must be >= 0")
    if len(set(remote_blocks)) != len(remote_blocks):
        raise ValueError("block_ops: a remote block id appears twice (two sources for one destination)")
    return _merge(sorted((lb * block_bytes, rb * block_bytes, block_bytes)
                         for lb, rb in zip(local_blocks, remote_blocks)))


def _merge(runs: list[tuple[int, int, int]]) -> list[WriteOp]:
    """Merge sorted (local, remote, length) runs that continue each other on both sides."""
    merged: list[WriteOp] = []
    if not runs:
        return merged
    local, remote, length = runs[0]
    for nl, nr, nn in runs[1:]:
        if local + length == nl and remote + length == nr:
            length += nn
        else:
            merged.append(WriteOp(local, remote, length))
            local, remote, length = nl, nr, nn
    merged.append(WriteOp(local, remote, length))
    return merged
