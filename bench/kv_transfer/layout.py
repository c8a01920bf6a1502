"""The KV layout the moves use (the checkpoint's, built from its config without loading weights),
the remote block lists and how many repetitions a cell gets. Pure but ``layout_shape`` (reads the
config) and ``make_layout`` (torch)."""

from __future__ import annotations

import json
import random
from pathlib import Path

POOL_HEADROOM = 2  # pools hold this many times the largest prompt's blocks (room to fragment)


def layout_shape(model_dir: Path, block_size: int) -> dict:
    """KVLayout keyword arguments (all but num_blocks) from the checkpoint's text config, as the engine does."""
    config = json.loads((model_dir / "config.json").read_text())
    text = config.get("text_config") or config
    head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    return {"num_layers": text["num_hidden_layers"], "block_size": block_size,
            "num_kv_heads": text["num_key_value_heads"], "head_dim": head_dim}


def make_layout(shape: dict, num_blocks: int):  # -> KVLayout
    """The float32 ``KVLayout`` of ``shape`` (``layout_shape``) with ``num_blocks`` blocks."""
    import torch

    from stages.engine.kv_pool import KVLayout

    return KVLayout(num_blocks=num_blocks, dtype=torch.float32, **shape)


def fragmented_ids(n: int, pool_blocks: int, rng: random.Random, block_bytes: int) -> list[int]:
    """Remote ids drawn at random from the pool, none continuing its predecessor (one op per block)."""
    from transfer.ops import block_ops

    for _ in range(100):
        ids = rng.sample(range(pool_blocks), n)
        if len(block_ops(list(range(n)), ids, block_bytes)) == n:
            return ids
        for i in range(1, n):  # repair adjacent pairs by swapping with a random later position
            if ids[i] == ids[i - 1] + 1:
                j = rng.randrange(n)
                ids[i], ids[j] = ids[j], ids[i]
        if len(block_ops(list(range(n)), ids, block_bytes)) == n:
            return ids
    raise RuntimeError("could not draw a fully fragmented block list")


def reps_for(reps: int, nbytes: int) -> int:
    """More repetitions for the small cells (cheap, and the most disturbed by scheduling), fewer for 64 MiB."""
    if nbytes <= (4 << 20):
        return 4 * reps
    return reps if nbytes < (32 << 20) else max(3, reps * 2 // 3)
