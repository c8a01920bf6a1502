"""The KV pool's size (``stages.engine.kv_sizing``) with faked GPU numbers: each branch, its explanation, and
the flag each refusal names."""

from __future__ import annotations

import pytest

from stages.engine.kv_sizing import GIB, MIB, NON_TORCH_BYTES, GpuMemory, KVSizing, activation_bytes, fixed_pool, gpu_pool

pytestmark = pytest.mark.unit

BLOCK = 896 * 1024  # Qwen2-VL-7B in bf16: 28 layers x K,V x 4 kv heads x 128 x 2 B x 16 tokens
H100 = 80 * GIB


def sized(free_at_start: int = 79 * GIB, utilization: float = 0.9, min_blocks: int = 2048) -> KVSizing:
    """An H100 with 15 GiB of weights, 1 GiB of activations, 896 KiB blocks; a 32k context by default."""
    return gpu_pool(GpuMemory(total=H100, free_at_start=free_at_start, weights=15 * GIB), utilization,
                    activations=GIB, block_bytes=BLOCK, min_blocks=min_blocks)


def test_the_pool_gets_the_share_left_after_weights_activations_and_the_non_torch_reserve():
    result = sized()
    expected_bytes = int(H100 * 0.9) - 15 * GIB - GIB - NON_TORCH_BYTES
    assert result.blocks == expected_bytes // BLOCK
    assert result.bytes == result.blocks * BLOCK
    assert result.bytes <= expected_bytes < result.bytes + BLOCK
    assert result.source == ("--gpu-memory-utilization 0.9: 80.0 GiB x 0.9 - 15.0 GiB weights - 1.0 GiB activations "
                             "- 1.0 GiB non-torch")


def test_two_stages_sharing_one_gpu_each_size_from_their_own_share_not_what_the_other_holds():
    first = sized(utilization=0.45, free_at_start=79 * GIB)
    # the second starts after the first took its whole share: less is free, but its own share is the same
    second = sized(utilization=0.45, free_at_start=79 * GIB - int(H100 * 0.45))
    assert first == second
    assert first.bytes + 15 * GIB + GIB + NON_TORCH_BYTES <= int(H100 * 0.45)


def test_less_free_at_start_than_the_share_is_refused_naming_the_flag():
    with pytest.raises(ValueError, match=r"^--gpu-memory-utilization 0.9: 40.0 GiB free of 80.0 GiB at start, less "
                                         r"than the 72.0 GiB asked for \(other processes use the rest\); lower "
                                         r"--gpu-memory-utilization, stop them, or give --kv-cache-mib$"):
        sized(free_at_start=40 * GIB)


def test_weights_that_fill_the_share_are_refused_naming_the_flag():
    with pytest.raises(ValueError, match=r"^--gpu-memory-utilization 0.2: 80.0 GiB x 0.2 - 15.0 GiB weights - 1.0 GiB "
                                         r"activations - 1.0 GiB non-torch leaves no room for the KV pool; raise "
                                         r"--gpu-memory-utilization, lower --max-batched-tokens or use a smaller --dtype$"):
        sized(utilization=0.2)


def test_a_pool_too_small_for_one_max_model_len_sequence_is_refused_naming_both_flags():
    # 0.25 x 80 GiB - 17 GiB = 3 GiB = 3510 blocks of 896 KiB; a 128k context needs 8192
    with pytest.raises(ValueError, match=r"^--gpu-memory-utilization 0.25: the KV pool's 3510 blocks hold less than "
                                         r"one --max-model-len sequence \(8192 blocks\); raise "
                                         r"--gpu-memory-utilization or lower --max-model-len$"):
        sized(utilization=0.25, min_blocks=8192)
    assert sized(utilization=0.25, min_blocks=3510).blocks == 3510  # exactly one sequence fits


@pytest.mark.parametrize("utilization", [0, -0.1, 1.01])
def test_a_utilization_outside_zero_to_one_is_refused(utilization):
    with pytest.raises(ValueError, match=rf"^--gpu-memory-utilization must be in \(0, 1\], got {utilization}$"):
        sized(utilization=utilization)


def test_all_of_the_gpu_is_allowed():
    assert sized(utilization=1.0, free_at_start=H100).bytes > sized().bytes


def test_fixed_pool_holds_as_many_whole_blocks_as_fit():
    assert fixed_pool(512, 8 * 1024 * 16, "cpu default 512 MiB") == KVSizing(4096, 512 * MIB, "cpu default 512 MiB")
    assert fixed_pool(1, 3 * 100_000, "--kv-cache-mib 1") == KVSizing(3, 900_000, "--kv-cache-mib 1")


def test_a_fixed_pool_smaller_than_one_block_is_refused_naming_the_flag():
    with pytest.raises(ValueError, match=r"^--kv-cache-mib 1 is smaller than one KV block \(2097152 B\); "
                                         r"raise --kv-cache-mib$"):
        fixed_pool(1, 2 * MIB, "--kv-cache-mib 1")


def test_activation_estimate_counts_the_step_budget_and_the_logits():
    # Qwen2-VL-7B, bf16, vLLM's 2048 tokens a step, 64 sequences: hidden 3584, MLP 18944, vocab 152064
    estimate = activation_bytes(batched_tokens=2048, max_num_seqs=64, hidden=3584, intermediate=18944, vocab=152064,
                                itemsize=2)
    assert estimate == 2048 * (8 * 3584 + 4 * 18944) * 2 + 64 * 152064 * 4 * 3
    assert 0.5 * GIB < estimate < 0.7 * GIB
