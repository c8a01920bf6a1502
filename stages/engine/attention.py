"""Paged attention over the KV pool, plugged into transformers' attention-function registry.

The runner packs every scheduled token of a step into one sequence (batch dimension 1): first
each prefill's prompt, then one token per decoding request. The model's own attention modules
project and rotate q/k/v and then call ``paged_attention`` (registered as ``ATTENTION_NAME``),
which receives the step's ``AttentionMetadata`` through the ``epd_attn`` keyword that the runner
passes to every decoder layer. Nothing is global: the metadata carries the pool.

Prefills here always start from an empty context (no prefix reuse, no chunking), so a prefill
attends causally over its own fresh keys, exactly as Hugging Face's SDPA path does. Decodes
gather their context from the pool with a padding mask, all in one batched SDPA call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from stages.engine.kv_pool import KVPool

ATTENTION_NAME = "epd_paged"


@dataclass
class DecodeGroup:
    start: int  # index of the first decode token in the packed sequence; decodes run to the end
    kv_blocks: torch.Tensor  # [B, Lmax] block id of each context slot (padded with 0)
    kv_offsets: torch.Tensor  # [B, Lmax] offset within the block
    mask: torch.Tensor | None  # [B, 1, 1, Lmax] True where a slot is real context; None if no padding


@dataclass
class AttentionMetadata:
    pool: KVPool
    slot_blocks: torch.Tensor  # [T] where each packed token's K/V is stored
    slot_offsets: torch.Tensor  # [T]
    prefill_spans: list[tuple[int, int]]  # [start, end) of each prefill in the packed sequence
    decode: DecodeGroup | None


def build_decode_group(start: int, blocks: list[list[int]], lengths: list[int], block_size: int) -> DecodeGroup:
    """Index tensors for decoding requests whose contexts (including the new token) have ``lengths``."""
    max_len = max(lengths)
    slots = torch.arange(max_len)
    kv_blocks = torch.zeros((len(lengths), max_len), dtype=torch.long)
    for row, (owned, length) in enumerate(zip(blocks, lengths)):
        table = torch.tensor(owned, dtype=torch.long)
        kv_blocks[row, :length] = table[slots[:length] // block_size]
    kv_offsets = (slots % block_size).expand(len(lengths), max_len).contiguous()
    mask = None
    if min(lengths) != max_len:
        mask = (slots[None, :] < torch.tensor(lengths)[:, None])[:, None, None, :]
    return DecodeGroup(start=start, kv_blocks=kv_blocks, kv_offsets=kv_offsets, mask=mask)


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    epd_attn: AttentionMetadata | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """query [1, H, T, D], key/value [1, KVH, T, D] -> ([1, T, H, D], None), as transformers expects."""
    if epd_attn is None:
        raise RuntimeError(f"{ATTENTION_NAME} attention needs the step's AttentionMetadata (epd_attn=...)")
    meta, layer = epd_attn, module.layer_idx
    meta.pool.write(layer, meta.slot_blocks, meta.slot_offsets, key[0].transpose(0, 1), value[0].transpose(0, 1))
    out = query.new_empty(query.shape[2], query.shape[1], query.shape[3])
    for start, end in meta.prefill_spans:
        span = slice(start, end)
        o = F.scaled_dot_product_attention(
            query[:, :, span], key[:, :, span], value[:, :, span], is_causal=True, scale=scaling, enable_gqa=True
        )
        out[span] = o[0].transpose(0, 1)
    if meta.decode is not None:
        group = meta.decode
        q = query[0, :, group.start :].transpose(0, 1).unsqueeze(2)  # [B, H, 1, D]
        k, v = meta.pool.gather(layer, group.kv_blocks, group.kv_offsets)  # [B, L, KVH, D]
        o = F.scaled_dot_product_attention(
            q, k.transpose(1, 2), v.transpose(1, 2), attn_mask=group.mask, scale=scaling, enable_gqa=True
        )
        out[group.start :] = o[:, :, 0]
    return out.unsqueeze(0), None


def _no_mask(*args, **kwargs) -> None:
    """The runner never asks transformers for a mask; paged attention builds its own."""
    return None


AttentionInterface.register(ATTENTION_NAME, paged_attention)
AttentionMaskInterface.register(ATTENTION_NAME, _no_mask)
