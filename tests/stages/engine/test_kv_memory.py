"""``kv_memory``: which sizing each case takes, and that the GPU path hands ``gpu_pool`` the config's and the
measured numbers. ``torch.cuda``'s two reads are faked (no GPU here); scripts/gpu-check.sh runs them for real."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from stages.engine import kv_memory
from stages.engine.config import EngineConfig
from stages.engine.kv_memory import GpuAtStart, memory_at_start, size_pool
from stages.engine.kv_pool import KVLayout
from stages.engine.kv_sizing import GIB, MIB, GpuMemory, KVSizing, activation_bytes, gpu_pool

pytestmark = pytest.mark.unit

QWEN2_VL_7B = SimpleNamespace(hidden_size=3584, intermediate_size=18944, vocab_size=152064)
ONE_BLOCK = KVLayout(num_blocks=1, num_layers=28, block_size=16, num_kv_heads=4, head_dim=128, dtype=torch.bfloat16)
GPU = torch.device("cuda:0")


@pytest.fixture
def fake_gpu(monkeypatch):
    monkeypatch.setattr(kv_memory.torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(kv_memory.torch.cuda, "memory_allocated", lambda device=None: 15 * GIB)


def test_the_gpu_path_sizes_from_the_share_the_weights_and_the_step_budget(fake_gpu):
    config = EngineConfig(model="/m", gpu_memory_utilization=0.5, max_batched_tokens=2048, max_num_seqs=32)
    sizing = size_pool(config, GpuAtStart(total=80 * GIB, free=79 * GIB), GPU, ONE_BLOCK, QWEN2_VL_7B, 32768)
    activations = activation_bytes(batched_tokens=2048, max_num_seqs=32, hidden=3584, intermediate=18944,
                                   vocab=152064, itemsize=2)
    assert sizing == gpu_pool(GpuMemory(total=80 * GIB, free_at_start=79 * GIB, weights=15 * GIB), 0.5, activations,
                              ONE_BLOCK.block_bytes, min_blocks=2048)
    assert sizing.source.startswith("--gpu-memory-utilization 0.5: 80.0 GiB x 0.5 - 15.0 GiB weights")


def test_kv_cache_mib_wins_and_a_cpu_keeps_its_default(fake_gpu):
    block = ONE_BLOCK.block_bytes
    pinned = EngineConfig(model="/m", kv_cache_mib=64)
    assert size_pool(pinned, None, GPU, ONE_BLOCK, QWEN2_VL_7B, 32768) == KVSizing(
        (64 * MIB) // block, (64 * MIB) // block * block, "--kv-cache-mib 64")
    cpu = size_pool(EngineConfig(model="/m", device="cpu"), None, torch.device("cpu"), ONE_BLOCK, QWEN2_VL_7B, 32768)
    assert cpu == KVSizing((512 * MIB) // block, (512 * MIB) // block * block, "cpu default 512 MiB")


def test_the_gpu_is_read_at_start_only_when_it_sizes_the_pool(monkeypatch):
    monkeypatch.setattr(kv_memory.torch.cuda, "mem_get_info", lambda device=None: (79 * GIB, 80 * GIB))
    assert memory_at_start(EngineConfig(model="/m"), GPU) == GpuAtStart(total=80 * GIB, free=79 * GIB)
    assert memory_at_start(EngineConfig(model="/m", kv_cache_mib=64), GPU) is None
    assert memory_at_start(EngineConfig(model="/m"), torch.device("cpu")) is None
