"""Typed values that carry a prompt and its images through the engine and between stages."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class ImageInput:
    """One image after the model's image processor: what the vision tower eats.

    ``pixel_values``: Qwen-VL: [patches, patch_dim] with ``grid_thw`` (t, h, w) in patches;
    LLaVA: [3, H, W] with ``grid_thw`` None. ``num_tokens``: placeholder tokens it fills in the prompt.
    """

    pixel_values: torch.Tensor
    grid_thw: tuple[int, int, int] | None
    num_tokens: int


@dataclass(frozen=True)
class ImageEmbedding:
    """One image after the vision tower and projector: [num_tokens, hidden] (plus Qwen3-VL's
    deepstack features [num_deepstack_layers, num_tokens, hidden], which travel with it)."""

    embeds: torch.Tensor
    grid_thw: tuple[int, int, int] | None
    deepstack: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.embeds.shape[0]


@dataclass
class Prompt:
    """Token ids with image placeholders already expanded, and per image either pixels (to encode)
    or embeddings (encoded elsewhere). ``image_grids`` is all prefill needs for M-RoPE positions."""

    token_ids: list[int]
    images: list[ImageInput] = field(default_factory=list)
    embeddings: list[ImageEmbedding] | None = None

    @property
    def num_images(self) -> int:
        return len(self.embeddings) if self.embeddings is not None else len(self.images)

    @property
    def image_grids(self) -> list[tuple[int, int, int] | None]:
        source = self.embeddings if self.embeddings is not None else self.images
        return [item.grid_thw for item in source]
