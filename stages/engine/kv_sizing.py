"""How many KV blocks a stage's pool gets, and where that number came from. Pure: no torch, no I/O.

The engine (``stages/engine/kv_memory.py``) calls one of these once, after the weights are loaded and
before the pool is allocated:

- ``fixed_pool``: ``--kv-cache-mib`` when given (it always wins), or ``CPU_KV_CACHE_MIB`` on a CPU;
- ``gpu_pool``: on a GPU without ``--kv-cache-mib``, vLLM's ``--gpu-memory-utilization``: this process
  may use ``total x utilization`` of the GPU's memory for everything (weights, activations, the CUDA
  context, the KV pool); the pool gets what is left of that share after this process's own weights,
  the activation estimate (``activation_bytes``) and the non-torch reserve. Other processes on the same
  GPU (stages sharing one GPU, each with its own share) count only in the start check: like vLLM, a
  stage refuses to start when less is free at its start than its share.

The result's ``source`` is what ``/server_info`` reports as ``engine.kv_pool.source``. A ValueError
names the flag to change.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1 << 30
MIB = 1 << 20
# Device memory a CUDA process holds outside torch's allocator (the context, cuBLAS workspaces) and
# what the caching allocator holds beyond what is allocated: an estimate, checked by scripts/gpu-check.sh.
NON_TORCH_BYTES = 1 * GIB


@dataclass(frozen=True)
class GpuMemory:
    """What the engine measured on its GPU, in bytes: the GPU's ``total``, what was ``free_at_start`` before
    this process loaded anything (``torch.cuda.mem_get_info`` then), and what this process's tensors hold
    after loading (``torch.cuda.memory_allocated``: the ``weights``)."""

    total: int
    free_at_start: int
    weights: int


@dataclass(frozen=True)
class KVSizing:
    blocks: int
    bytes: int  # blocks x block bytes: the pool tensor's size
    source: str  # how ``blocks`` was chosen, for /server_info and the startup log


def fixed_pool(mib: int, block_bytes: int, source: str) -> KVSizing:
    """As many blocks as fit in ``mib`` MiB. ValueError naming --kv-cache-mib when not even one does."""
    blocks = (mib * MIB) // block_bytes
    if blocks < 1:
        raise ValueError(f"--kv-cache-mib {mib} is smaller than one KV block ({block_bytes} B); raise --kv-cache-mib")
    return KVSizing(blocks, blocks * block_bytes, source)


def activation_bytes(*, batched_tokens: int, max_num_seqs: int, hidden: int, intermediate: int, vocab: int,
                     itemsize: int) -> int:
    """An estimate of one step's peak activations beside the weights and the pool: per token of the
    step's budget, a few hidden-sized tensors (residual, norm, q/k/v, attention out: 8) and the MLP's
    gate, up and product (4 x intermediate, with slack), in the model's dtype; the sampled rows' logits
    in float32 with two processed copies. Not counted: attention scores (SDPA's fused kernels on a GPU
    keep none) and the vision tower's own activations. Not a profile; scripts/gpu-check.sh compares it
    with the measured peak."""
    per_token = (8 * hidden + 4 * intermediate) * itemsize
    return batched_tokens * per_token + max_num_seqs * vocab * 4 * 3


def gpu_pool(memory: GpuMemory, utilization: float, activations: int, block_bytes: int, min_blocks: int,
             non_torch: int = NON_TORCH_BYTES) -> KVSizing:
    """The pool of a GPU process with ``--gpu-memory-utilization utilization`` (in (0, 1]).

    ``activations``: ``activation_bytes``; ``min_blocks``: the blocks of one ``--max-model-len`` sequence;
    sizes in bytes. ValueError naming the flag to change when less is free than the share, when the
    weights and reserves alone fill the share, or when the pool would not hold one max-model-len sequence."""
    if not 0 < utilization <= 1:
        raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {utilization}")
    total, free_at_start, weights = memory.total, memory.free_at_start, memory.weights
    share = int(total * utilization)
    if free_at_start < share:
        raise ValueError(
            f"--gpu-memory-utilization {utilization}: {_gib(free_at_start)} free of {_gib(total)} at start, less than "
            f"the {_gib(share)} asked for (other processes use the rest); lower --gpu-memory-utilization, stop "
            "them, or give --kv-cache-mib")
    used = f"{_gib(weights)} weights - {_gib(activations)} activations - {_gib(non_torch)} non-torch"
    kv_bytes = share - weights - activations - non_torch
    if kv_bytes < block_bytes:
        raise ValueError(
            f"--gpu-memory-utilization {utilization}: {_gib(total)} x {utilization} - {used} leaves no room for "
            "the KV pool; raise --gpu-memory-utilization, lower --max-batched-tokens or use a smaller --dtype")
    blocks = kv_bytes // block_bytes
    if blocks < min_blocks:
        raise ValueError(
            f"--gpu-memory-utilization {utilization}: the KV pool's {blocks} blocks hold less than one --max-model-len "
            f"sequence ({min_blocks} blocks); raise --gpu-memory-utilization or lower --max-model-len")
    source = f"--gpu-memory-utilization {utilization}: {_gib(total)} x {utilization} - {used}"
    return KVSizing(blocks, blocks * block_bytes, source)


def _gib(n: int) -> str:
    return f"{n / GIB:.1f} GiB"
