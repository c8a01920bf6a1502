"""Decode attention that reads the KV pool's blocks in place: one Triton kernel, any block size and dtype.

What it replaces on a GPU: gathering every decode's whole (padded) context out of the pool into a
fresh tensor, per layer and per step, before SDPA. Here each program (one per request and query
head) walks its request's block table, loads ``TILE`` keys and values at a time straight from the
pool (``KVPool.keys(layer)`` / ``values(layer)``: a strided view [num_blocks, block_size,
kv_heads, head_dim]) and keeps an online softmax in float32, as flash attention does. GQA: query
head h reads KV head ``h // (heads // kv_heads)``.

flash-attn's ``flash_attn_with_kvcache`` takes the same view and a block table, but only for
fp16/bf16 and block sizes that are a multiple of 256; the runner prefers it then (``attention.py``).
Results match SDPA to float32 rounding, not bit for bit (a different summation order).

Checked on the CPU with Triton's interpreter (``TRITON_INTERPRET=1``, tests/stages/engine/test_device_paged_decode.py);
on a GPU by scripts/gpu-check.sh.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

TILE = 32  # context slots loaded per iteration


@triton.jit
def _decode_kernel(q_ptr, k_ptr, v_ptr, table_ptr, lengths_ptr, out_ptr, scale,
                   stride_qb, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                   stride_tb, stride_ob, stride_oh,
                   GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                   TILE_N: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    kv_head = h // GROUP
    length = tl.load(lengths_ptr + b)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + b * stride_qb + h * stride_qh + d, mask=d_ok, other=0.0).to(tl.float32)
    m_i = tl.full([1], float("-inf"), tl.float32)
    l_i = tl.zeros([1], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for start in range(0, length, TILE_N):
        slot = start + tl.arange(0, TILE_N)
        live = slot < length
        block = tl.load(table_ptr + b * stride_tb + slot // BLOCK_SIZE, mask=live, other=0).to(tl.int64)
        offset = slot % BLOCK_SIZE
        both = live[:, None] & d_ok[None, :]
        k_rows = block * stride_kb + offset * stride_ks + kv_head * stride_kh
        k = tl.load(k_ptr + k_rows[:, None] + d[None, :], mask=both, other=0.0).to(tl.float32)
        scores = tl.where(live, tl.sum(k * q[None, :], axis=1) * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=0))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new)
        v_rows = block * stride_vb + offset * stride_vs + kv_head * stride_vh
        v = tl.load(v_ptr + v_rows[:, None] + d[None, :], mask=both, other=0.0).to(tl.float32)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        m_i = m_new
    out = acc / l_i
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d_ok)


def paged_decode(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, block_table: torch.Tensor,
                 lengths: torch.Tensor, scale: float) -> torch.Tensor:
    """query [B, H, D] (one new token per request), keys/values [num_blocks, block_size, KVH, D]
    (last dim contiguous), block_table [B, W] int32 (block ids of each request's context, padded),
    lengths [B] int32 (context slots incl. the new token, >= 1) -> out [B, H, D] in query's dtype."""
    batch, heads, head_dim = query.shape
    num_blocks, block_size, kv_heads, _ = keys.shape
    if keys.stride(-1) != 1 or values.stride(-1) != 1 or query.stride(-1) != 1:
        raise ValueError("paged_decode needs a contiguous last dimension in query, keys and values")
    out = torch.empty_like(query)
    with torch.cuda.device(query.device) if query.is_cuda else contextlib.nullcontext():
        _decode_kernel[(batch, heads)](
            query, keys, values, block_table, lengths, out, scale,
            query.stride(0), query.stride(1), keys.stride(0), keys.stride(1), keys.stride(2),
            values.stride(0), values.stride(1), values.stride(2), block_table.stride(0), out.stride(0), out.stride(1),
            GROUP=heads // kv_heads, BLOCK_SIZE=block_size, HEAD_DIM=head_dim,
            BLOCK_D=triton.next_power_of_2(head_dim), TILE_N=TILE)
    return out
