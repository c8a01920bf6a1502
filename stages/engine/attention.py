"""Paged attention over the KV pool, plugged into transformers' attention-function registry.

The runner packs every scheduled token of a step into one sequence (batch dimension 1): first
each prefill's prompt, then one token per decoding request. The model's own attention modules
project and rotate q/k/v and then call ``paged_attention`` (registered as ``ATTENTION_NAME``),
which receives the step's ``AttentionMetadata`` through the ``epd_attn`` keyword that the runner
passes to every decoder layer. Nothing is global: the metadata carries the pool.

A prefill that starts the prompt (the whole prompt, or its first chunk) attends causally over its
own fresh keys, exactly as Hugging Face's SDPA path does. A later chunk of a chunked prefill
(``PrefillContext``) attends to the prompt's earlier tokens too: its queries read the K/V of every
prompt slot up to their own out of the pool (a copy through the request's blocks, which holds the
chunk's own K/V as well, written first), under a causal mask aligned to the end. Decodes read
their context from the pool with one of three kernels, chosen once per process (``decode_kernel``):

- ``"sdpa"`` (the CPU, and a GPU without Triton): gather each decode's context out of the pool
  (a copy, padded to the longest) and run one batched SDPA call with a padding mask;
- ``"flash"`` (a GPU with flash-attn, fp16/bf16, ``--block-size`` a multiple of 256):
  ``flash_attn_with_kvcache`` with a block table over ``KVPool.keys(layer)``, in place;
- ``"triton"`` (any other GPU case): ``paged_decode.py``, in place, any block size and dtype.

Every index tensor is made on the pool's device, once per step (``build_decode_group``).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from stages.engine.kv_pool import KVPool

ATTENTION_NAME = "epd_paged"
DECODE_KERNELS = ("sdpa", "flash", "triton")
FLASH_BLOCK_MULTIPLE = 256  # flash-attn 2: "Paged KV cache block size must be divisible by 256"


def decode_kernel(device: torch.device, dtype: torch.dtype, block_size: int, head_dim: int) -> str:
    """The decode kernel for this process (see the module docstring); "sdpa" on the CPU, so the
    CPU path is the one Hugging Face runs."""
    if device.type != "cuda":
        return "sdpa"
    if (dtype in (torch.float16, torch.bfloat16) and block_size % FLASH_BLOCK_MULTIPLE == 0 and head_dim <= 256
            and head_dim % 8 == 0 and torch.cuda.get_device_capability(device) >= (8, 0)
            and importlib.util.find_spec("flash_attn") is not None):
        return "flash"
    return "triton" if importlib.util.find_spec("triton") is not None else "sdpa"


@dataclass
class DecodeGroup:
    start: int  # index of the first decode token in the packed sequence; decodes run to the end
    kernel: str  # one of DECODE_KERNELS
    block_table: torch.Tensor  # [B, W] int32: block ids of each context, padded with 0 (paged kernels)
    lengths: torch.Tensor  # [B] int32: context slots of each decode, the new token's included
    kv_blocks: torch.Tensor | None = None  # "sdpa" only: [B, Lmax] block id of each context slot (0 past the end)
    kv_offsets: torch.Tensor | None = None  # "sdpa" only: [B, Lmax] offset within the block
    mask: torch.Tensor | None = None  # "sdpa" only: [B, 1, 1, Lmax] True where a slot is real; None if no padding


@dataclass
class PrefillContext:
    """A prefill chunk that continues a prompt: where its keys live in the pool and what each query sees."""

    kv_blocks: torch.Tensor  # [L] block of each prompt slot 0 .. L-1 (L = earlier tokens + the chunk)
    kv_offsets: torch.Tensor  # [L] offset within the block
    mask: torch.Tensor  # [chunk, L] True where query i (prompt slot L - chunk + i) may attend slot j


@dataclass
class AttentionMetadata:
    pool: KVPool
    slot_blocks: torch.Tensor  # [T] where each packed token's K/V is stored
    slot_offsets: torch.Tensor  # [T]
    prefill_spans: list[tuple[int, int]]  # [start, end) of each prefill in the packed sequence
    decode: DecodeGroup | None
    prefill_contexts: list[PrefillContext | None] | None = None  # per span; None: the span starts its prompt


def build_prefill_context(blocks: list[int], context: int, chunk: int, block_size: int,
                          device: torch.device) -> PrefillContext:
    """Index tensors, on ``device``, for a chunk of ``chunk`` tokens after ``context`` prompt tokens
    already in the pool, for a request holding ``blocks``."""
    slots = torch.arange(context + chunk, device=device)
    table = torch.tensor(blocks[: -(-(context + chunk) // block_size)], dtype=torch.long, device=device)
    queries = torch.arange(context, context + chunk, device=device)
    return PrefillContext(kv_blocks=table[slots // block_size], kv_offsets=slots % block_size,
                          mask=slots[None, :] <= queries[:, None])


def build_decode_group(start: int, blocks: list[list[int]], lengths: list[int], block_size: int,
                       device: torch.device, kernel: str = "sdpa") -> DecodeGroup:
    """Index tensors, on ``device``, for decoding requests whose contexts (including the new token)
    have ``lengths`` and live in ``blocks`` (each request's own list, at least long enough)."""
    used = [-(-length // block_size) for length in lengths]
    width = max(used)
    table = torch.tensor([owned[:n] + [0] * (width - n) for owned, n in zip(blocks, used)], dtype=torch.int32,
                         device=device)
    sizes = torch.tensor(lengths, dtype=torch.int32, device=device)
    group = DecodeGroup(start=start, kernel=kernel, block_table=table, lengths=sizes)
    if kernel == "sdpa":
        max_len = max(lengths)
        slots = torch.arange(max_len, device=device)
        real = slots[None, :] < sizes[:, None]
        group.kv_blocks = torch.where(real, table.long()[:, slots // block_size], 0)
        group.kv_offsets = (slots % block_size).expand(len(lengths), max_len).contiguous()
        group.mask = None if min(lengths) == max_len else real[:, None, None, :]
    return group


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
    if not isinstance(layer, int):
        raise RuntimeError(f"{ATTENTION_NAME} attention needs a module with an int layer_idx, got {type(layer).__name__}")
    meta.pool.write(layer, meta.slot_blocks, meta.slot_offsets, key[0].transpose(0, 1), value[0].transpose(0, 1))
    out = query.new_empty(query.shape[2], query.shape[1], query.shape[3])
    contexts = meta.prefill_contexts or [None] * len(meta.prefill_spans)
    for (start, end), context in zip(meta.prefill_spans, contexts):
        span = slice(start, end)
        if context is None:
            o = F.scaled_dot_product_attention(
                query[:, :, span], key[:, :, span], value[:, :, span], is_causal=True, scale=scaling, enable_gqa=True
            )
        else:
            k, v = meta.pool.gather(layer, context.kv_blocks, context.kv_offsets)  # [L, KVH, D]: a copy
            o = F.scaled_dot_product_attention(query[:, :, span], k.transpose(0, 1).unsqueeze(0),
                                               v.transpose(0, 1).unsqueeze(0), attn_mask=context.mask,
                                               scale=scaling, enable_gqa=True)
        out[span] = o[0].transpose(0, 1)
    if meta.decode is not None:
        group = meta.decode
        q = query[0, :, group.start :].transpose(0, 1)  # [B, H, D]
        out[group.start :] = _DECODE[group.kernel](meta.pool, layer, group, q, scaling)
    return out.unsqueeze(0), None


# Each: (pool, layer, group, q [B, H, D], scaling or None for 1/sqrt(D)) -> [B, H, D]
def _decode_sdpa(pool: KVPool, layer: int, group: DecodeGroup, q: torch.Tensor, scaling: float | None) -> torch.Tensor:
    if group.kv_blocks is None or group.kv_offsets is None:
        raise RuntimeError("an sdpa decode group needs its slot indices (build_decode_group(kernel='sdpa'))")
    k, v = pool.gather(layer, group.kv_blocks, group.kv_offsets)  # [B, L, KVH, D]: a copy
    o = F.scaled_dot_product_attention(
        q.unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=group.mask, scale=scaling, enable_gqa=True
    )
    return o[:, :, 0]


def _decode_flash(pool: KVPool, layer: int, group: DecodeGroup, q: torch.Tensor, scaling: float | None) -> torch.Tensor:
    from flash_attn import flash_attn_with_kvcache

    o = flash_attn_with_kvcache(q.unsqueeze(1), pool.keys(layer), pool.values(layer), cache_seqlens=group.lengths,
                                block_table=group.block_table, softmax_scale=scaling)
    return o[:, 0]


def _decode_triton(pool: KVPool, layer: int, group: DecodeGroup, q: torch.Tensor, scaling: float | None) -> torch.Tensor:
    from stages.engine.paged_decode import paged_decode

    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    return paged_decode(q.contiguous(), pool.keys(layer), pool.values(layer), group.block_table, group.lengths, scale)


_DECODE = {"sdpa": _decode_sdpa, "flash": _decode_flash, "triton": _decode_triton}


def _no_mask(*args, **kwargs) -> None:
    """The runner never asks transformers for a mask; paged attention builds its own."""
    return None


AttentionInterface.register(ATTENTION_NAME, paged_attention)
AttentionMaskInterface.register(ATTENTION_NAME, _no_mask)
