"""The paged KV pool: one tensor per process, allocated once, registrable with a transfer engine.

Layout ``[num_blocks, num_layers, 2 (K, V), block_size, num_kv_heads, head_dim]``, block-major:
one block holds every layer's keys and values for ``block_size`` token slots in one contiguous
run of ``block_bytes`` bytes. A prefill server therefore moves a prompt's KV to a decode server
with one write per run of contiguous block ids, whatever the layer count. Attention reads and
writes it by (block id, offset) index pairs, never reshaping it (a reshape would copy); a paged
kernel reads one layer's keys as the strided view ``keys(layer)`` ([num_blocks, block_size,
num_kv_heads, head_dim], block stride = one whole block), which is the layout flash-attn's paged
KV takes.

The pool lives on the engine's device. On a GPU, kernels that write it run asynchronously: the
runner marks the end of each step's writes (``mark_written``) and whoever hands blocks to a
transfer engine first waits for that mark (``sync``), so the bytes it sends are the finished ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVLayout:
    """Shape of the pool: all a peer needs to know to write into it."""

    num_blocks: int
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def block_bytes(self) -> int:
        return self.bytes_per_token * self.block_size


class KVPool:
    """Owns the pool tensor. Created once per prefill/decode/colocated process; lives as long as it."""

    def __init__(self, layout: KVLayout, device: torch.device | str = "cpu") -> None:
        self.layout = layout
        self.device = torch.device(device)
        self.tensor = torch.zeros(
            (layout.num_blocks, layout.num_layers, 2, layout.block_size, layout.num_kv_heads, layout.head_dim),
            dtype=layout.dtype, device=self.device,
        )
        self._written: torch.cuda.Event | None = None  # the last step's end of writes (GPU only)

    @property
    def memory(self) -> str:
        """The memory kind a transfer engine registers: "VRAM" on a GPU, "DRAM" on the CPU."""
        return "VRAM" if self.device.type == "cuda" else "DRAM"

    @property
    def device_id(self) -> int:
        """The GPU's index for "VRAM" (what NIXL and UCX call the device id); 0 for "DRAM"."""
        return (self.device.index or 0) if self.device.type == "cuda" else 0

    @property
    def data_ptr(self) -> int:
        return self.tensor.data_ptr()

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    def write(self, layer: int, blocks: torch.Tensor, offsets: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store ``key``/``value`` ([tokens, kv_heads, head_dim]) at the given (block, offset) slots."""
        self.tensor[blocks, layer, 0, offsets] = key
        self.tensor[blocks, layer, 1, offsets] = value

    def gather(self, layer: int, blocks: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values at index tensors of any shape S: each [*S, kv_heads, head_dim] (a copy)."""
        return self.tensor[blocks, layer, 0, offsets], self.tensor[blocks, layer, 1, offsets]

    def copy_out(self, blocks: list[int]) -> torch.Tensor:
        """The given blocks (every layer, K and V) copied to host memory: a swapped-out request's KV."""
        return self.tensor[torch.tensor(blocks, dtype=torch.long, device=self.device)].to("cpu")

    def copy_in(self, blocks: list[int], host: torch.Tensor) -> None:
        """Write ``host`` (from ``copy_out``, as many blocks) into ``blocks``: a swapped-in request's KV."""
        if host.shape[0] != len(blocks):
            raise ValueError(f"{host.shape[0]} swapped blocks do not fit {len(blocks)} blocks")
        self.tensor[torch.tensor(blocks, dtype=torch.long, device=self.device)] = host.to(self.device)

    def copy_blocks(self, sources: list[int], targets: list[int]) -> None:
        """Copy block ``sources[i]`` (every layer, K and V) into ``targets[i]``, on the device: a forked
        sequence's own copy of its parent's last, partial prompt block (copy-on-write at the fork)."""
        if len(sources) != len(targets):
            raise ValueError(f"{len(sources)} source blocks for {len(targets)} targets")
        source = torch.tensor(sources, dtype=torch.long, device=self.device)
        self.tensor[torch.tensor(targets, dtype=torch.long, device=self.device)] = self.tensor[source]

    def keys(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s keys in place: a view [num_blocks, block_size, kv_heads, head_dim]."""
        return self.tensor[:, layer, 0]

    def values(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s values in place, as ``keys``."""
        return self.tensor[:, layer, 1]

    def mark_written(self) -> None:
        """Engine thread, after a step's forward pass has queued its writes: remember where they end
        on the device's current stream. Nothing to do on the CPU, where writes are done on return."""
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            self._written = event

    def sync(self) -> None:
        """Any thread: return once every write marked so far is in memory, so that blocks of finished
        steps can be handed to a transfer engine (which reads the memory itself, outside torch's
        streams). Call it right before a write; a no-op on the CPU."""
        written = self._written
        if written is not None:
            written.synchronize()
