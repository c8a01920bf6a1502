"""Model adapters by ``config.model_type``, and the one loading path for generated and real checkpoints."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForImageTextToText

from stages.engine.models.base import ModelAdapter
from stages.engine.models.llava import LlavaAdapter
from stages.engine.models.qwen_vl import QwenVLAdapter

ADAPTERS: dict[str, type[ModelAdapter]] = {
    model_type: adapter for adapter in (QwenVLAdapter, LlavaAdapter) for model_type in adapter.model_types
}


def load_adapter(path: str | Path, dtype: torch.dtype, attn_implementation: str) -> ModelAdapter:
    """Load a checkpoint directory and wrap it. The language model's attention is switched to
    ``attn_implementation``; the vision tower keeps SDPA."""
    config = AutoConfig.from_pretrained(path)
    adapter_cls = ADAPTERS.get(config.model_type)
    if adapter_cls is None:
        raise ValueError(f"model type {config.model_type!r} is not supported; supported: {sorted(ADAPTERS)}")
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
    model.eval()
    model.config.get_text_config()._attn_implementation = attn_implementation
    return adapter_cls(model)
