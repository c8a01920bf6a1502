"""The KV pool's size on this process's device: the engine's thin layer over ``kv_sizing`` (the pure part).

The engine calls ``memory_at_start`` before it loads the weights and ``size_pool`` after, before it
allocates the pool. On a GPU without ``--kv-cache-mib`` these read ``torch.cuda.mem_get_info`` (the
GPU's total and free memory, all processes) and ``torch.cuda.memory_allocated`` (this process's own
tensors: the weights); nothing else here touches the device. Proven on a GPU by scripts/gpu-check.sh
only; the CPU runs the same calls with ``start`` None.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stages.engine.block_allocator import blocks_for_tokens
from stages.engine.config import CPU_KV_CACHE_MIB, EngineConfig
from stages.engine.kv_pool import KVLayout
from stages.engine.kv_sizing import GpuMemory, KVSizing, activation_bytes, fixed_pool, gpu_pool


@dataclass(frozen=True)
class GpuAtStart:
    total: int
    free: int


def memory_at_start(config: EngineConfig, device: torch.device) -> GpuAtStart | None:
    """The GPU's total and free bytes before this process loads anything; None unless the pool will be
    sized from ``--gpu-memory-utilization`` (a GPU and no ``--kv-cache-mib``)."""
    if device.type != "cuda" or config.kv_cache_mib is not None:
        return None
    free, total = torch.cuda.mem_get_info(device)
    return GpuAtStart(total=total, free=free)


def size_pool(config: EngineConfig, start: GpuAtStart | None, device: torch.device, one_block: KVLayout,
              text_config, max_model_len: int) -> KVSizing:
    """The pool's blocks of ``one_block``'s shape: ``--kv-cache-mib`` when given, ``CPU_KV_CACHE_MIB`` on a
    CPU, else ``kv_sizing.gpu_pool`` with this process's weights as allocated now. ValueError naming a flag."""
    block_bytes = one_block.block_bytes
    if config.kv_cache_mib is not None:
        return fixed_pool(config.kv_cache_mib, block_bytes, f"--kv-cache-mib {config.kv_cache_mib}")
    if start is None:
        return fixed_pool(CPU_KV_CACHE_MIB, block_bytes, f"cpu default {CPU_KV_CACHE_MIB} MiB")
    torch.cuda.synchronize(device)
    activations = activation_bytes(
        batched_tokens=config.batched_tokens, max_num_seqs=config.max_num_seqs, hidden=text_config.hidden_size,
        intermediate=getattr(text_config, "intermediate_size", None) or 4 * text_config.hidden_size,
        vocab=text_config.vocab_size, itemsize=one_block.dtype.itemsize)
    memory = GpuMemory(total=start.total, free_at_start=start.free, weights=torch.cuda.memory_allocated(device))
    return gpu_pool(memory, config.gpu_memory_utilization, activations, block_bytes,
                    min_blocks=blocks_for_tokens(max_model_len, config.block_size))
