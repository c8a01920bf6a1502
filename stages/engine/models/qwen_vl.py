"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL: M-RoPE positions, merged patches, Qwen3-VL deepstack."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol, cast

import torch

from contract.video import VideoPlan
from stages.engine.config import VISION
from stages.engine.models.base import ModelAdapter, SizeRule
from stages.engine.multimodal import ImageEmbedding, ImageInput


@dataclass(frozen=True)
class QwenSizes(SizeRule):
    """The Qwen2-VL image processor's resize rule (``smart_resize`` to multiples of patch x merge,
    pixels within [min_pixels, max_pixels]); one image is one temporal patch."""

    patch_size: int
    merge_size: int
    min_pixels: int
    max_pixels: int

    def grid(self, width: int, height: int) -> tuple[int, int, int]:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        rows, cols = smart_resize(height, width, self.patch_size * self.merge_size, self.min_pixels, self.max_pixels)
        return 1, rows // self.patch_size, cols // self.patch_size

    def num_tokens(self, width: int, height: int) -> int:
        return math.prod(self.grid(width, height)) // self.merge_size**2


class _RopeModel(Protocol):
    """The inner Qwen-VL model's M-RoPE position rule."""

    def get_rope_index(self, input_ids: torch.Tensor, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]: ...


class QwenVLAdapter(ModelAdapter):
    family = "qwen_vl"
    model_types = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
    vision_modules = ("model.visual",)  # the tower, its patch merger (the projector) and Qwen3-VL's deepstack mergers

    @property
    def image_token_id(self) -> int:
        return self.config.image_token_id

    @property
    def video_token_id(self) -> int:
        return self.config.video_token_id

    @property
    def video_rule(self) -> str:
        return "qwen3_vl" if self.config.model_type == "qwen3_vl" else "qwen2_vl"

    @property
    def timestamped_video(self) -> bool:
        return self.config.model_type == "qwen3_vl"

    @property
    def merge_size(self) -> int:
        return self.config.vision_config.spatial_merge_size

    @property
    def position_rows(self) -> int:
        return 3

    @property
    def deepstack_layers(self) -> int:
        """Qwen3-VL: one per ``deepstack_visual_indexes`` entry; Qwen2-VL and Qwen2.5-VL have none."""
        return len(getattr(self.config.vision_config, "deepstack_visual_indexes", None) or ())

    def num_image_tokens(self, image: ImageInput) -> int:
        if image.grid_thw is None:
            raise ValueError(f"a {self.family} image needs its grid_thw")
        return math.prod(image.grid_thw) // self.merge_size**2

    def size_rule(self, image_processor: Any) -> QwenSizes:
        size = image_processor.size
        return QwenSizes(image_processor.patch_size, image_processor.merge_size, size["shortest_edge"],
                         size["longest_edge"])

    @torch.inference_mode()
    def encode(self, images: list[ImageInput]) -> list[ImageEmbedding]:
        self._require(VISION)
        if not images:
            return []
        device = self.device
        pooled, out = self.image_features(
            torch.cat([im.pixel_values for im in images]).to(device),
            image_grid_thw=torch.tensor([im.grid_thw for im in images], device=device),
        )
        deepstack = getattr(out, "deepstack_features", None)
        return [
            ImageEmbedding(
                embeds=embeds,
                grid_thw=im.grid_thw,
                deepstack=torch.stack([layer[i] for layer in deepstack]) if deepstack else None,
            )
            for i, (im, embeds) in enumerate(zip(images, pooled))
        ]

    def prefill_positions(self, token_ids: list[int], grids: list,
                          videos: list[VideoPlan | None]) -> tuple[torch.Tensor, int]:
        ids = torch.tensor([token_ids], device="cpu")  # host-side index arithmetic: see the base class
        images = [grid for grid, video in zip(grids, videos) if video is None]
        plans = [video for video in videos if video is not None]
        extra = {}
        if plans and self.config.model_type == "qwen2_5_vl":  # absolute time: seconds per temporal patch
            extra["second_per_grid_ts"] = torch.tensor([plan.seconds_per_grid for plan in plans])
        positions, delta = cast(_RopeModel, self.submodule("model")).get_rope_index(
            ids,
            mm_token_type_ids=(ids == self.image_token_id).int() + 2 * (ids == self.video_token_id).int(),
            image_grid_thw=torch.tensor(images, device="cpu") if images else None,
            video_grid_thw=torch.tensor([list(plan.grid) for plan in plans], device="cpu") if plans else None,
            **extra,
        )
        return positions[:, 0], int(delta.item())

    def layer_hook(self, layer: int, hidden: torch.Tensor, image_rows: torch.Tensor, embeddings: list[ImageEmbedding]) -> torch.Tensor:
        if not embeddings or embeddings[0].deepstack is None or layer >= embeddings[0].deepstack.shape[0]:
            return hidden
        rows = [e.deepstack[layer] for e in embeddings if e.deepstack is not None]
        if len(rows) != len(embeddings):
            raise ValueError("some of the step's image embeddings carry deepstack features and some do not")
        features = torch.cat(rows).to(hidden.device, hidden.dtype)
        hidden = hidden.clone()
        hidden[0, image_rows] = hidden[0, image_rows] + features
        return hidden
