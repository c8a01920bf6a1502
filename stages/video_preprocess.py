"""A video's sampled frames -> what the vision tower eats, as the family's video processor makes it.

transformers' Qwen video processors need torchvision, which cannot be installed beside a CPU torch,
so their steps are written out here over torch alone, in their order and arithmetic:

1. each frame (H x W x 3 uint8, from ``cache.video_bytes.decode_frames``) resized to the plan's size,
   bicubic with antialiasing on the uint8 frame (torchvision's native CPU path; elsewhere in float,
   clamped and rounded back to uint8, as torchvision does);
2. rescale and normalize fused: ``(x - mean / rescale) / (std / rescale)`` in float32;
3. frames padded to a multiple of the temporal patch by repeating the last, then cut into patches:
   ``[grid_t * grid_h * grid_w, 3 * temporal_patch * patch * patch]``, merge-window order.

``VideoConfig.load`` reads the checkpoint's ``video_preprocessor_config.json`` (else the video keys of
``preprocessor_config.json``, as Qwen2-VL and Qwen2.5-VL ship them) into the sampling the server starts
from (``contract.video.VideoSampling``) and the normalization constants. Who calls: the prompt builder
(colocated, a PD prefill) and the encoder server, each on a worker thread.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from contract.video import VideoPlan, VideoSampling
from stages.engine.multimodal import ImageInput

VIDEO_CONFIG = "video_preprocessor_config.json"
_FALLBACK_CONFIG = "preprocessor_config.json"
_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class VideoFrames:
    """One video of a request, decoded: its plan's frames (H x W x 3 uint8, in ``plan.indices`` order)."""

    frames: list[np.ndarray]
    plan: VideoPlan


@dataclass(frozen=True)
class VideoConfig:
    """A checkpoint's video processing: its sampling before any flag or request, and normalization."""

    sampling: VideoSampling
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    rescale_factor: float

    @classmethod
    def load(cls, model_dir: str | Path, rule: str) -> VideoConfig:
        """From ``video_preprocessor_config.json``, else ``preprocessor_config.json``; the processor class's
        defaults for what neither says. ValueError naming the file for a value it cannot take."""
        path = Path(model_dir) / VIDEO_CONFIG
        if not path.is_file():
            path = Path(model_dir) / _FALLBACK_CONFIG
        config: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else {}
        try:
            sampling = VideoSampling.from_processor_config(rule, config)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{path}: {exc}") from None
        default_mean, default_std = ((0.5,) * 3, (0.5,) * 3) if rule == "qwen3_vl" else (_CLIP_MEAN, _CLIP_STD)
        return cls(sampling, _triple(config.get("image_mean"), default_mean), _triple(config.get("image_std"), default_std),
                   float(config.get("rescale_factor") or 1 / 255))


def preprocess_video(frames: list[np.ndarray], plan: VideoPlan, config: VideoConfig) -> ImageInput:
    """The plan's frames (in ``plan.indices`` order) as one ``ImageInput`` with the plan's grid.
    ValueError if the frames do not match the plan."""
    if len(frames) != len(plan.indices):
        raise ValueError(f"the plan samples {len(plan.indices)} frames but {len(frames)} were decoded")
    video = torch.from_numpy(np.stack(frames)).permute(0, 3, 1, 2).contiguous()  # [T, 3, H, W] uint8
    video = _resize(video, plan.height, plan.width)
    scale = 1 / config.rescale_factor
    mean = torch.tensor(config.mean, dtype=torch.float32).view(1, 3, 1, 1) * scale
    std = torch.tensor(config.std, dtype=torch.float32).view(1, 3, 1, 1) * scale
    video = (video.to(torch.float32) - mean) / std
    sampling = config.sampling
    patches = _patchify(video, sampling.patch_size, sampling.merge_size, sampling.temporal_patch_size)
    if patches.shape[0] != plan.grid[0] * plan.grid[1] * plan.grid[2]:
        raise ValueError(f"the frames make {patches.shape[0]} patches; the plan's grid {plan.grid} wants "
                         f"{plan.grid[0] * plan.grid[1] * plan.grid[2]}")
    return ImageInput(patches, plan.grid, plan.num_tokens)


def _resize(video: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """torchvision's ``resize(video, (height, width), BICUBIC, antialias=True)`` of uint8 frames."""
    if tuple(video.shape[-2:]) == (height, width):
        return video
    if video.device.type == "cpu":  # torchvision resizes uint8 natively on the CPU for bicubic
        return F.interpolate(video, size=[height, width], mode="bicubic", align_corners=False, antialias=True)
    out = F.interpolate(video.to(torch.float32), size=[height, width], mode="bicubic", align_corners=False,
                        antialias=True)
    return out.clamp_(0, 255).round_().to(torch.uint8)


def _patchify(video: torch.Tensor, patch: int, merge: int, temporal: int) -> torch.Tensor:
    """``[T, C, H, W]`` -> ``[grid_t * grid_h * grid_w, C * temporal * patch * patch]`` (transformers'
    ``Qwen2VLVideoProcessor.patchify`` for one video)."""
    if pad := -video.shape[0] % temporal:
        video = torch.cat([video, video[-1:].expand(pad, -1, -1, -1)])
    frames, channels, height, width = video.shape
    grid_t, grid_h, grid_w = frames // temporal, height // patch, width // patch
    patches = video.view(grid_t, temporal, channels, grid_h // merge, merge, patch, grid_w // merge, merge, patch)
    patches = patches.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return patches.reshape(grid_t * grid_h * grid_w, channels * temporal * patch * patch)


def _triple(value: Any, default: tuple[float, float, float]) -> tuple[float, float, float]:
    if isinstance(value, list | tuple) and len(value) == 3:
        return float(value[0]), float(value[1]), float(value[2])
    if isinstance(value, int | float):
        return float(value), float(value), float(value)
    return default
