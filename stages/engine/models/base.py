"""The model adapter interface: what the engine needs from one model family.

An adapter wraps a loaded Hugging Face model and exposes its parts (token embedding, decoder
layers, rotary embedding, final norm, LM head, vision tower) plus the family's rules (how many
placeholder tokens an image fills, how positions are numbered). The engine never branches on the
family; adding a family is one adapter file registered in ``models/__init__.py``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch
from torch import nn

from stages.engine.multimodal import ImageEmbedding, ImageInput


class ModelAdapter(ABC):
    family: ClassVar[str]
    model_types: ClassVar[tuple[str, ...]]  # config.model_type values this adapter serves

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.config = model.config
        self.text_config = model.config.get_text_config()

    # --- parts -----------------------------------------------------------------------------
    @property
    @abstractmethod
    def text_model(self) -> nn.Module:
        """The decoder stack: has ``embed_tokens``, ``layers``, ``norm`` and ``rotary_emb``."""

    @property
    def lm_head(self) -> nn.Module:
        return self.model.lm_head

    @property
    @abstractmethod
    def image_token_id(self) -> int: ...

    # --- rules -----------------------------------------------------------------------------
    @abstractmethod
    def num_image_tokens(self, image: ImageInput) -> int:
        """Placeholder tokens one preprocessed image fills in the prompt."""

    @abstractmethod
    def encode(self, images: list[ImageInput]) -> list[ImageEmbedding]:
        """Run the vision tower and projector; one embedding per image, in order."""

    def prefill_positions(self, token_ids: list[int], grids: list) -> tuple[torch.Tensor, int]:
        """Positions [rows, len] of a fresh prompt and the rope delta (decode position = tokens so far + delta).
        Default: plain 1-D positions 0..len-1, delta 0."""
        return torch.arange(len(token_ids)).unsqueeze(0), 0

    @property
    def position_rows(self) -> int:
        return 1

    def layer_hook(self, layer: int, hidden: torch.Tensor, image_rows: torch.Tensor, embeddings: list[ImageEmbedding]) -> torch.Tensor:
        """Called after each decoder layer with the packed rows holding image tokens (Qwen3-VL deepstack)."""
        return hidden
