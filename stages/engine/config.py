"""Engine configuration: frozen, validated at construction, shared by every stage that runs a model.

Importing this module is cheap (no torch), so the CLI builds its parsers from these defaults quickly."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

DTYPES = ("float32", "bfloat16", "float16")  # names of torch dtypes; torch is imported only when a model loads
VISION, TEXT = "vision", "text"  # the halves of a model (see stages/engine/models/base.py)
PARTS = (VISION, TEXT)


@dataclass(frozen=True)
class EngineConfig:
    model: str
    dtype: str = "float32"
    block_size: int = 16
    kv_cache_mib: int = 512
    max_num_seqs: int = 64
    max_batched_tokens: int = 8192
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    threads: int = 1
    seed: int = 0
    parts: tuple[str, ...] = PARTS  # what to load: ("text",) for a stage that never encodes images

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        for name in ("block_size", "kv_cache_mib", "max_num_seqs", "max_batched_tokens", "threads"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(self, name)}")
        if not self.parts or not set(self.parts) <= set(PARTS):
            raise ValueError(f"parts must be a non-empty subset of {PARTS}, got {self.parts}")
        if self.max_model_len is not None and self.max_model_len <= 1:
            raise ValueError(f"--max-model-len must be > 1, got {self.max_model_len}")

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype)
