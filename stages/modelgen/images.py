"""Image processor configs (written as preprocessor_config.json) and the Qwen families' video processor
config (video_preprocessor_config.json, written as JSON: its processor class needs torchvision)."""

from typing import Any

from .sizes import Size


def qwen(size: Size, patch: int, mean_std_half: bool):
    """Dynamic resolution: each side a multiple of patch * merge, pixels bounded by the token limits."""
    from transformers import Qwen2VLImageProcessorPil

    factor = patch * 2
    extra: dict[str, Any] = {"image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]} if mean_std_half else {}
    return Qwen2VLImageProcessorPil(
        size={
            "shortest_edge": size.vision.min_image_tokens * factor * factor,
            "longest_edge": size.vision.max_image_tokens * factor * factor,
        },
        patch_size=patch,
        temporal_patch_size=2,
        merge_size=2,
        **extra,
    )


def qwen_video(size: Size, patch: int, family: str) -> dict:
    """The video processor config the family's hub checkpoints ship, at this size: 2 frames a second,
    4-768 frames, a temporal patch of 2. Pixel bounds: per frame as for images (Qwen2-VL, Qwen2.5-VL),
    or over all sampled frames together, 16 frames at the image bound (Qwen3-VL: its processor's
    ``size`` is a budget for the whole video)."""
    factor = patch * 2
    frames = 16 if family == "qwen3_vl" else 1
    half = family == "qwen3_vl"
    return {
        "video_processor_type": "Qwen3VLVideoProcessor" if half else "Qwen2VLVideoProcessor",
        "do_sample_frames": True, "fps": 2.0, "min_frames": 4, "max_frames": 768,
        "size": {"shortest_edge": size.vision.min_image_tokens * factor * factor,
                 "longest_edge": size.vision.max_image_tokens * factor * factor * frames},
        "patch_size": patch, "temporal_patch_size": 2, "merge_size": 2,
        "do_resize": True, "resample": 3, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
        "image_mean": [0.5, 0.5, 0.5] if half else [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.5, 0.5, 0.5] if half else [0.26862954, 0.26130258, 0.27577711],
        "do_convert_rgb": True,
    }


def clip(size: Size):
    """Resize the short side, centre-crop a square (LLaVA-1.5 uses CLIPImageProcessor)."""
    from transformers import CLIPImageProcessorPil

    s = size.vision.llava_image_size
    return CLIPImageProcessorPil(size={"shortest_edge": s}, crop_size={"height": s, "width": s})


def siglip(size: Size):
    """Squash to a fixed square, mean and std 0.5."""
    from transformers import SiglipImageProcessorPil

    s = size.vision.llava_image_size
    return SiglipImageProcessorPil(size={"height": s, "width": s})
