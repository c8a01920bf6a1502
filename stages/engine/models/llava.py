"""LLaVA: a CLIP or SigLIP tower, a projector, and a Llama/Qwen2/Mistral language model."""

from __future__ import annotations

import torch
from torch import nn

from stages.engine.models.base import ModelAdapter
from stages.engine.multimodal import ImageEmbedding, ImageInput


class LlavaAdapter(ModelAdapter):
    family = "llava"
    model_types = ("llava",)

    @property
    def text_model(self) -> nn.Module:
        return self.model.model.language_model

    @property
    def image_token_id(self) -> int:
        config = self.config
        return getattr(config, "image_token_id", None) or config.image_token_index

    def num_image_tokens(self, image: ImageInput) -> int:
        vision = self.config.vision_config
        _, height, width = image.pixel_values.shape
        patches = (height // vision.patch_size) * (width // vision.patch_size)
        has_cls = vision.model_type == "clip_vision_model"
        dropped = 1 if self.config.vision_feature_select_strategy == "default" else 0
        return patches + int(has_cls) - dropped

    @torch.inference_mode()
    def encode(self, images: list[ImageInput]) -> list[ImageEmbedding]:
        if not images:
            return []
        out = self.model.model.get_image_features(
            pixel_values=torch.stack([im.pixel_values for im in images]),
            vision_feature_layer=self.config.vision_feature_layer,
            vision_feature_select_strategy=self.config.vision_feature_select_strategy,
        )
        return [ImageEmbedding(embeds=embeds, grid_thw=None) for embeds in out.pooler_output]
