"""What moves: a size in MiB as a number of KV blocks, the remote block lists of a cell, the pools'
size and the repetitions per cell. Pure (``fragmented_ids`` draws from the given ``Random``)."""

from __future__ import annotations

import random
from dataclasses import dataclass

from bench.kv_transfer.layout import fragmented_ids

MIB = 1 << 20
LAYOUTS = ("contiguous", "fragmented")
POOL_SPARE = 2  # the pools hold twice the largest move's blocks: room for a fragmented sample


@dataclass(frozen=True)
class Cell:
    """One cell: ``mib`` of KV, ``blocks`` source blocks ``0..blocks-1`` written to ``remote_ids``."""

    mib: int
    layout: str
    remote_ids: tuple[int, ...]

    @property
    def blocks(self) -> int:
        return len(self.remote_ids)

    @property
    def local_ids(self) -> list[int]:
        return list(range(self.blocks))


def blocks_for(mib: int, block_bytes: int) -> int:
    """Whole blocks holding ``mib`` MiB; ValueError unless ``block_bytes`` divides it exactly (the
    cells are named by their size)."""
    if (mib * MIB) % block_bytes:
        raise ValueError(f"{mib} MiB is not a whole number of {block_bytes}-byte blocks")
    return mib * MIB // block_bytes


def pool_blocks(sizes_mib: list[int], block_bytes: int) -> int:
    """Blocks of each side's pool: ``POOL_SPARE`` times the largest move."""
    return POOL_SPARE * max(blocks_for(m, block_bytes) for m in sizes_mib)


def cells(sizes_mib: list[int], layouts: list[str], block_bytes: int, pool: int, rng: random.Random) -> list[Cell]:
    """Every (size, layout) cell. Contiguous: one run ending 3 blocks before the pool's end (so the
    local and remote offsets differ); fragmented: a random sample of the pool, no id following its
    predecessor (one op per block)."""
    out = []
    for mib in sizes_mib:
        n = blocks_for(mib, block_bytes)
        for layout in layouts:
            if layout == "contiguous":
                ids = list(range(pool - n - 3, pool - 3))
            elif layout == "fragmented":
                ids = fragmented_ids(n, pool, rng, block_bytes)
            else:
                raise ValueError(f"layout is one of {LAYOUTS}, got {layout!r}")
            out.append(Cell(mib, layout, tuple(ids)))
    return out


def reps_for(reps: int, mib: int) -> int:
    """``reps`` up to 16 MiB, 2/3 of it (at least 3) above: the large cells are the slow ones."""
    return reps if mib <= 16 else max(3, reps * 2 // 3)
