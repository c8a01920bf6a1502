"""Engine configuration: frozen, validated at construction, shared by every stage that runs a model."""

from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        for name in ("block_size", "kv_cache_mib", "max_num_seqs", "max_batched_tokens", "threads"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len <= 1:
            raise ValueError(f"--max-model-len must be > 1, got {self.max_model_len}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]
