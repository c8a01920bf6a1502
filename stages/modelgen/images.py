"""Image processor configs (written as preprocessor_config.json; no video processor is written)."""

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
