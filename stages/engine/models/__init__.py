"""Model adapters by ``config.model_type``, and the one loading path for generated and real checkpoints.

Role loading: ``load_adapter(..., parts=("vision",))`` (the encoder) or ``parts=("text",)`` (prefill
and decode) never materializes the other half. Transformers builds the model on the ``meta``
device; a subclass of the model's own class drops the unused submodules right after that (while
they are still empty), so loading reads and allocates only the kept half. Everything else is
transformers' ordinary path (checkpoint key conversions, non-persistent buffers such as rotary
``inv_freq``, dtype, tied weights), so the kept modules hold exactly what a full load gives them.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, PretrainedConfig, PreTrainedModel
from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING

from stages.engine.models.base import PARTS, ModelAdapter
from stages.engine.models.llava import LlavaAdapter
from stages.engine.models.qwen_vl import QwenVLAdapter

ADAPTERS: dict[str, type[ModelAdapter]] = {
    model_type: adapter for adapter in (QwenVLAdapter, LlavaAdapter) for model_type in adapter.model_types
}


def adapter_class(config: PretrainedConfig) -> type[ModelAdapter]:
    """The adapter of ``config.model_type``; ValueError if no adapter serves it."""
    adapter_cls = ADAPTERS.get(config.model_type)
    if adapter_cls is None:
        raise ValueError(f"model type {config.model_type!r} is not supported; supported: {sorted(ADAPTERS)}")
    return adapter_cls


def load_adapter(path: str | Path, dtype: torch.dtype, attn_implementation: str,
                 parts: tuple[str, ...] = PARTS, device: torch.device | str = "cpu") -> ModelAdapter:
    """Load the ``parts`` of a checkpoint directory (``"vision"``, ``"text"``, or both) onto ``device``
    and wrap them. The language model's attention is switched to ``attn_implementation``; the vision
    tower keeps SDPA. Weights are read on the CPU and then moved (every parameter and buffer)."""
    if not parts or set(parts) - set(PARTS):
        raise ValueError(f"parts must be a non-empty subset of {PARTS}, got {parts}")
    parts = tuple(part for part in PARTS if part in parts)
    config = AutoConfig.from_pretrained(path)
    adapter_cls = adapter_class(config)
    model_cls: type[PreTrainedModel] = MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING[type(config)]  # type: ignore[assignment]  # transformers types every auto mapping's values as the tokenizers' (slow, fast) pair
    dropped = adapter_cls.modules_of(tuple(part for part in PARTS if part not in parts))
    if dropped:
        model_cls = _without(model_cls, dropped)  # type: ignore[arg-type]  # a class is hashable: mypy takes nn.Module's instance __hash__ for the class's
    model = model_cls.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
    if torch.device(device).type != "cpu":
        model.to(device)  # type: ignore[arg-type]  # transformers declares PreTrainedModel.to as @wraps(nn.Module.to), which mypy reads as unbound
    model.eval()
    model.config.get_text_config()._attn_implementation = attn_implementation
    return adapter_cls(model, parts)


@functools.cache
def _without(model_cls: type[PreTrainedModel], dropped: tuple[str, ...]) -> type[PreTrainedModel]:
    """``model_cls`` whose instances set the submodules at ``dropped`` (dotted paths) to None as soon
    as they are built: from_pretrained then neither allocates nor loads them, ignores their checkpoint
    keys, and ties no weight that involves them. Same name and module as ``model_cls``, so transformers
    applies the same checkpoint conversions."""

    def gone(name: str) -> bool:
        return any(name == path or name.startswith(path + ".") for path in dropped)

    def __init__(self: PreTrainedModel, config: PretrainedConfig, *args: Any, **kwargs: Any) -> None:
        model_cls.__init__(self, config, *args, **kwargs)
        for path in dropped:
            parent, _, name = path.rpartition(".")
            setattr(self.get_submodule(parent) if parent else self, name, None)
        self.all_tied_weights_keys = {k: v for k, v in self.all_tied_weights_keys.items()
                                      if not gone(k) and not gone(v)}
        self._keys_to_ignore_on_load_unexpected = set(self._keys_to_ignore_on_load_unexpected or ()) | {
            rf"^{re.escape(path)}(\.|$)" for path in dropped}

    return type(model_cls.__name__, (model_cls,), {
        "__init__": __init__, "__module__": model_cls.__module__, "__qualname__": model_cls.__qualname__})
