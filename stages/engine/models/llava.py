"""LLaVA: a CLIP or SigLIP tower, a projector, and a Llama/Qwen2/Mistral language model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from stages.engine.config import VISION
from stages.engine.models.base import ModelAdapter, SizeRule
from stages.engine.multimodal import ImageEmbedding, ImageInput


@dataclass(frozen=True)
class FixedSize(SizeRule):
    """Every image fills the same number of tokens, whatever its size (it is resized to one shape)."""

    tokens: int

    def num_tokens(self, width: int, height: int) -> int:
        return self.tokens

    def grid(self, width: int, height: int) -> None:
        return None


class LlavaAdapter(ModelAdapter):
    family = "llava"
    model_types = ("llava",)
    vision_modules = ("model.vision_tower", "model.multi_modal_projector")

    @property
    def image_token_id(self) -> int:
        config = self.config
        return getattr(config, "image_token_id", None) or config.image_token_index

    def num_image_tokens(self, image: ImageInput) -> int:
        _, height, width = image.pixel_values.shape
        return self._tokens_for_pixels(width, height)

    def size_rule(self, image_processor: Any) -> FixedSize:
        """Every image becomes the processor's fixed output size (CLIP: resize, then center crop to
        ``crop_size``; SigLIP: resize to ``size``), whatever its own size."""
        crop, size = getattr(image_processor, "crop_size", None), image_processor.size
        if getattr(image_processor, "do_center_crop", False) and crop:
            return FixedSize(self._tokens_for_pixels(crop["width"], crop["height"]))
        if image_processor.do_resize and size.get("height") and size.get("width"):
            return FixedSize(self._tokens_for_pixels(size["width"], size["height"]))
        raise ValueError(f"the image processor ({type(image_processor).__name__}, size={dict(size)}) does not "
                         "give every image one fixed size; the token count depends on the pixels")

    def _tokens_for_pixels(self, width: int, height: int) -> int:
        vision = self.config.vision_config
        patches = (height // vision.patch_size) * (width // vision.patch_size)
        has_cls = vision.model_type == "clip_vision_model"
        dropped = 1 if self.config.vision_feature_select_strategy == "default" else 0
        return patches + int(has_cls) - dropped

    @torch.inference_mode()
    def encode(self, images: list[ImageInput]) -> list[ImageEmbedding]:
        self._require(VISION)
        if not images:
            return []
        embeds, _ = self.image_features(
            torch.stack([im.pixel_values for im in images]).to(self.device),
            vision_feature_layer=self.config.vision_feature_layer,
            vision_feature_select_strategy=self.config.vision_feature_select_strategy,
        )
        return [ImageEmbedding(embeds=one, grid_thw=None) for one in embeds]
