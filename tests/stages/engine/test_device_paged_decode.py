"""The GPU decode kernels against the CPU path: same attention, read from the pool's blocks in place.

``paged_decode`` (Triton) is checked against SDPA over the gathered context, on pools with several
block sizes, GQA groups and head sizes, for contexts that end inside a block, on a block boundary
and past several kernel tiles. On a machine without a GPU it runs in Triton's interpreter
(``TRITON_INTERPRET=1``, set by tests/support/devices.py); without Triton it is skipped. On a
GPU (``EPD_TEST_DEVICE=cuda``) it runs for real, and flash-attn's block-table path is checked too
where it is installed. An engine whose decodes go through the kernel gives the same greedy tokens.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from stages.engine.attention import build_decode_group, decode_kernel
from stages.engine.config import EngineConfig
from stages.engine.sampling_params import SamplingParams
from stages.loading import load_engine
from tests.support.devices import DEVICE, on_gpu
from tests.support.generated_models import model_dir
from tests.support.hf_reference import random_image

pytest.importorskip("triton")
if not on_gpu() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("without a GPU the kernel runs in Triton's interpreter: TRITON_INTERPRET=1 (tests/support/devices.py sets "
                "it; here something imported triton first)", allow_module_level=True)
from stages.engine.paged_decode import paged_decode  # noqa: E402

TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def reference(pool: torch.Tensor, layer: int, q: torch.Tensor, tables: list[list[int]], lengths: list[int],
              scale: float) -> torch.Tensor:
    """SDPA over each request's context gathered out of the pool (what the CPU path computes)."""
    block_size = pool.shape[3]
    out = []
    for row, (table, length) in enumerate(zip(tables, lengths)):
        slots = torch.arange(length, device=pool.device)
        blocks = torch.tensor(table, device=pool.device)[slots // block_size]
        k, v = pool[blocks, layer, 0, slots % block_size], pool[blocks, layer, 1, slots % block_size]
        out.append(F.scaled_dot_product_attention(q[row][:, None].float(), k.transpose(0, 1).float(),
                                                  v.transpose(0, 1).float(), scale=scale, enable_gqa=True)[:, 0])
    return torch.stack(out)


def random_case(block_size: int, heads: int, kv_heads: int, head_dim: int, lengths: list[int], dtype: torch.dtype):
    generator = torch.Generator().manual_seed(block_size * 1000 + heads * 10 + head_dim)
    num_blocks = sum(-(-n // block_size) for n in lengths) + 3
    pool = torch.randn((num_blocks, 2, 2, block_size, kv_heads, head_dim), generator=generator).to(DEVICE, dtype)
    order = torch.randperm(num_blocks, generator=generator).tolist()  # blocks scattered through the pool
    tables, start = [], 0
    for n in lengths:
        used = -(-n // block_size)
        tables.append(order[start:start + used])
        start += used
    q = torch.randn((len(lengths), heads, head_dim), generator=generator).to(DEVICE, dtype)
    return pool, q, tables


DTYPES = [torch.float32] + ([torch.float16, torch.bfloat16] if on_gpu() else [])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size, heads, kv_heads, head_dim", [
    (16, 4, 2, 32),  # GQA 2, the default block size
    (4, 6, 2, 24),  # GQA 3, a head size that is no power of two, small blocks
    (32, 2, 2, 64),  # no GQA, one block spans a whole tile
])
def test_paged_decode_matches_sdpa_over_the_gathered_context(dtype, block_size, heads, kv_heads, head_dim):
    lengths = [1, block_size, block_size + 1, 70, 5]  # one slot; a full block; one past; several tiles
    pool, q, tables = random_case(block_size, heads, kv_heads, head_dim, lengths, dtype)
    layer, scale = 1, head_dim ** -0.5
    group = build_decode_group(0, tables, lengths, block_size, torch.device(DEVICE), kernel="triton")
    got = paged_decode(q, pool[:, layer, 0], pool[:, layer, 1], group.block_table, group.lengths, scale)
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got.float(), reference(pool, layer, q, tables, lengths, scale),
                               atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.unit
def test_the_sdpa_group_indexes_exactly_the_context():
    """The gather path's index tensors: each slot's (block, offset) inside the context, block 0 and
    a False mask past it."""
    group = build_decode_group(3, [[7, 2, 9], [4]], [5, 2], 2, torch.device(DEVICE), kernel="sdpa")
    assert group.kv_blocks.tolist() == [[7, 7, 2, 2, 9], [4, 4, 0, 0, 0]]
    assert group.kv_offsets.tolist() == [[0, 1, 0, 1, 0]] * 2
    assert group.mask[:, 0, 0].tolist() == [[True] * 5, [True, True, False, False, False]]
    assert group.block_table.tolist() == [[7, 2, 9], [4, 0, 0]] and group.lengths.tolist() == [5, 2]


@pytest.mark.unit
@pytest.mark.skipif(not on_gpu(), reason="flash-attn runs on a GPU only")
def test_flash_attn_block_table_matches_sdpa():
    flash = pytest.importorskip("flash_attn")
    block_size, lengths = 256, [1, 300, 256, 513]
    pool, q, tables = random_case(block_size, 8, 2, 64, lengths, torch.bfloat16)
    group = build_decode_group(0, tables, lengths, block_size, torch.device(DEVICE), kernel="flash")
    out = flash.flash_attn_with_kvcache(q.unsqueeze(1), pool[:, 0, 0], pool[:, 0, 1], cache_seqlens=group.lengths,
                                        block_table=group.block_table, softmax_scale=0.125)[:, 0]
    torch.testing.assert_close(out.float(), reference(pool, 0, q, tables, lengths, 0.125), atol=2e-2, rtol=2e-2)


@pytest.mark.unit
def test_the_cpu_uses_sdpa_and_a_gpu_reads_in_place():
    assert decode_kernel(torch.device("cpu"), torch.float32, 16, 64) == "sdpa"
    if on_gpu():
        assert decode_kernel(torch.device(DEVICE), torch.float32, 16, 64) == "triton"
        assert decode_kernel(torch.device(DEVICE), torch.bfloat16, 16, 64) == "triton"  # flash-attn: blocks of 256


def test_an_engine_decoding_with_the_kernel_gives_the_same_greedy_tokens():
    engine, prompts = load_engine(EngineConfig(model=str(model_dir("qwen2_vl")), kv_cache_mib=16, device=DEVICE,
                                               block_size=4), pixels=True)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    built = [prompts.build([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what?"}]}],
                           [random_image(64, 48, seed=3)]),
             prompts.build([{"role": "user", "content": "tell me a long story about the sea"}], [])]

    def run(kernel: str, tag: str) -> list[list[int]]:
        engine.runner.decode_kernel = kernel
        requests = [engine.add_request(f"{tag}-{i}", prompt, params) for i, prompt in enumerate(built)]
        for _ in range(params.max_tokens + 2):
            if engine.has_work():
                engine.step()
        assert not engine.has_work() and all(len(r.output_ids) == params.max_tokens for r in requests)
        return [r.output_ids for r in requests]

    assert run("triton", "paged") == run("sdpa", "gathered")
