"""A pure-Python allocator of fixed-size KV blocks, with the index of prefix caching.

The pool holds ``num_blocks`` blocks of ``block_size`` token slots. A request holds a list of block
ids; the allocator only hands ids out and takes them back. It never touches memory and does no I/O,
so the scheduler and the decode server's handshake can ask it freely.

Contract: ``can_allocate`` is free of side effects and may be asked any number of times;
``allocate`` commits and raises if the answer would have been no. Whoever holds a list of blocks
(from ``allocate``, ``share`` or ``retain``) frees it exactly once; a double free or a foreign id raises, so a
leak or a double release shows up in tests as an error instead of a silent miscount.

Prefix caching: a block whose KV is complete may be ``register``-ed under its chain hash
(``stages.engine.prefix_cache``). A registered block is *cached*: ``cached_prefix`` finds it, and
``share`` gives another holder a reference to it. Blocks are reference-counted; ``free`` drops one
reference. A cached block nobody references stays cached (``num_cached``, least recently freed
first) and is still free: ``allocate`` hands out never-cached free blocks first and evicts
(unregisters) cached ones only when those run out. ``num_used`` counts blocks referenced by
someone, so an idle engine is back to 0 whatever it keeps cached.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Collection


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
        self._free: deque[int] = deque(range(num_blocks))  # neither referenced nor cached
        self._refs: dict[int, int] = {}  # referenced block -> its references (>= 1)
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; least recently freed first
        self._hash_of: dict[int, bytes] = {}  # cached (registered) block -> its chain hash
        self._block_of: dict[bytes, int] = {}  # chain hash -> its cached block

    @property
    def num_free(self) -> int:
        """Blocks ``allocate`` can hand out now (cached ones nobody references included)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        """Blocks referenced by at least one holder."""
        return len(self._refs)

    @property
    def num_cached(self) -> int:
        """Cached blocks nobody references: kept for later hits, evicted when the pool needs them."""
        return len(self._evictable)

    def can_allocate(self, num_blocks: int, shared: Collection[int] = ()) -> bool:
        """Whether ``allocate(num_blocks)`` would succeed after ``share(shared)`` (which takes the
        shared blocks that are free out of the free count)."""
        taken = sum(1 for block in shared if block in self._evictable)
        return 0 <= num_blocks <= self.num_free - taken

    def allocate(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` blocks; the caller holds them until it calls ``free``. Never-cached
        blocks go first, then cached ones nobody references, least recently freed first (evicted)."""
        if not self.can_allocate(num_blocks):
            raise MemoryError(f"asked for {num_blocks} KV blocks, {self.num_free} free of {self.num_blocks}")
        blocks = []
        for _ in range(num_blocks):
            if self._free:
                block = self._free.popleft()
            else:
                block, _ = self._evictable.popitem(last=False)
                del self._block_of[self._hash_of.pop(block)]
            self._refs[block] = 1
            blocks.append(block)
        return blocks

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block. Each id must be referenced and appear once. A block
        left unreferenced becomes free: cached ones stay cached (most recently freed last)."""
        if len(set(blocks)) != len(blocks) or not all(block in self._refs for block in blocks):
            raise ValueError(f"freeing blocks that are not in use: {sorted(set(blocks) - set(self._refs))}")
        released = []
        for block in blocks:
            self._refs[block] -= 1
            if self._refs[block]:
                continue
            del self._refs[block]
            if block in self._hash_of:
                self._evictable[block] = None
            else:
                released.append(block)
        # Freed blocks go to the front in order, so the next request reuses a contiguous run.
        self._free.extendleft(sorted(released, reverse=True))

    def retain(self, blocks: list[int]) -> list[int]:
        """Take another reference to each of ``blocks``, all in use (a forked sequence shares its
        parent's prompt blocks); the caller frees them like its other blocks. ValueError, changing
        nothing, if one is not in use."""
        if not all(block in self._refs for block in blocks):
            raise ValueError(f"retaining blocks that are not in use: {sorted(set(blocks) - set(self._refs))}")
        for block in blocks:
            self._refs[block] += 1
        return list(blocks)

    # --- prefix caching ------------------------------------------------------------------------
    def cached_prefix(self, hashes: list[bytes]) -> list[int]:
        """The cached blocks of the longest prefix of ``hashes`` (a chain, block 0 first). No side effects."""
        blocks = []
        for block_hash in hashes:
            block = self._block_of.get(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def share(self, blocks: list[int]) -> list[int]:
        """Take a reference to each of ``blocks`` (cached: from ``cached_prefix``); the caller frees
        them like its other blocks. ValueError, changing nothing, if one is not cached."""
        if not all(block in self._hash_of for block in blocks):
            raise ValueError(f"sharing blocks that are not cached: {sorted(b for b in blocks if b not in self._hash_of)}")
        for block in blocks:
            self._evictable.pop(block, None)
            self._refs[block] = self._refs.get(block, 0) + 1
        return list(blocks)

    def register(self, block: int, block_hash: bytes) -> bool:
        """Cache ``block`` (referenced, its KV complete) under ``block_hash``. False, changing
        nothing, if the block or the hash is cached already (two requests computed the same block:
        the first one's copy stays the cached one). ValueError if the block is not referenced."""
        if block not in self._refs:
            raise ValueError(f"registering block {block}, which is not in use")
        if block in self._hash_of or block_hash in self._block_of:
            return False
        self._hash_of[block] = block_hash
        self._block_of[block_hash] = block
        return True
