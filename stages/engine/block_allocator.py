"""A pure-Python allocator of fixed-size KV blocks.

The pool holds ``num_blocks`` blocks of ``block_size`` token slots. A request owns a list of block
ids; the allocator only hands ids out and takes them back. It never touches memory and does no I/O,
so the scheduler and the decode server's handshake can ask it freely.

Contract: ``can_allocate`` is free of side effects and may be asked any number of times;
``allocate`` commits and raises if the answer would have been no. Whoever allocated a list of
blocks frees it exactly once; a double free or a foreign id raises, so a leak or a double release
shows up in tests as an error instead of a silent miscount.
"""

from __future__ import annotations

from collections import deque


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    """Number of blocks needed to hold ``num_tokens`` token slots."""
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    return -(-num_tokens // block_size)


class BlockAllocator:
    """Hands out block ids in free-list order; freed runs go back to the front in order, so a request's
    blocks tend to be contiguous (which lets a KV transfer coalesce them into few large writes)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be > 0, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def can_allocate(self, num_blocks: int) -> bool:
        return 0 <= num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` blocks; the caller owns them until it calls ``free``."""
        if not self.can_allocate(num_blocks):
            raise MemoryError(f"asked for {num_blocks} KV blocks, {len(self._free)} free of {self.num_blocks}")
        blocks = [self._free.popleft() for _ in range(num_blocks)]
        self._used.update(blocks)
        return blocks

    def free(self, blocks: list[int]) -> None:
        """Return blocks to the pool. Each id must be in use and appear once."""
        if len(set(blocks)) != len(blocks) or not self._used.issuperset(blocks):
            raise ValueError(f"freeing blocks that are not in use: {sorted(set(blocks) - self._used)}")
        self._used.difference_update(blocks)
        # Freed blocks go to the front in order, so the next request reuses a contiguous run.
        self._free.extendleft(sorted(blocks, reverse=True))
