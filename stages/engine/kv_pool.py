"""The paged KV pool: one tensor per process, allocated once, registrable with a transfer engine.

Layout ``[num_blocks, num_layers, 2 (K, V), block_size, num_kv_heads, head_dim]``, block-major:
one block holds every layer's keys and values for ``block_size`` token slots in one contiguous
run of ``block_bytes`` bytes. A prefill server therefore moves a prompt's KV to a decode server
with one write per run of contiguous block ids, whatever the layer count. Attention reads and
writes it by (block id, offset) index pairs, never reshaping it (a reshape would copy).
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

    @classmethod
    def for_budget(cls, budget_bytes: int, **shape) -> KVLayout:
        """The layout with as many blocks as fit in ``budget_bytes``."""
        probe = cls(num_blocks=1, **shape)
        num_blocks = budget_bytes // probe.block_bytes
        if num_blocks < 1:
            raise ValueError(f"KV cache budget {budget_bytes} B is smaller than one block ({probe.block_bytes} B)")
        return cls(num_blocks=num_blocks, **shape)


class KVPool:
    """Owns the pool tensor. Created once per prefill/decode/colocated process; lives as long as it."""

    def __init__(self, layout: KVLayout) -> None:
        self.layout = layout
        self.tensor = torch.zeros(
            (layout.num_blocks, layout.num_layers, 2, layout.block_size, layout.num_kv_heads, layout.head_dim),
            dtype=layout.dtype,
        )

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
        """Keys and values at index tensors of any shape S: each [*S, kv_heads, head_dim]."""
        return self.tensor[blocks, layer, 0, offsets], self.tensor[blocks, layer, 1, offsets]
