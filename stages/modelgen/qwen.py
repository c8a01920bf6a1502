"""Hugging Face configs for the Qwen VL families (M-RoPE language model + patch-merging ViT)."""

from .sizes import Size, text_fields
from .specials import SpecialTokens


def _mrope_section(head_dim: int, interleaved: bool) -> list[int]:
    """Split head_dim / 2 rotary frequencies over (t, h, w) in the proportions of the real checkpoints."""
    half = head_dim // 2
    if interleaved:  # Qwen3-VL: [24, 20, 20] at head_dim 128
        h = half * 5 // 16
        return [half - 2 * h, h, h]
    t = half // 4  # Qwen2-VL / Qwen2.5-VL: [16, 24, 24] at head_dim 128
    h = (half - t) // 2
    return [t, h, half - t - h]


def _deepstack_taps(depth: int, text_layers: int) -> list[int]:
    """Up to three ViT layers just below the last (Qwen3-VL-4B taps 8, 16, 24 of 27)."""
    n = min(3, depth - 1, text_layers)
    return list(range(depth - 1 - n, depth - 1))


def _token_ids(sp: SpecialTokens) -> dict:
    return {
        "image_token_id": sp.id(sp.image),
        "video_token_id": sp.id(sp.video),
        "vision_start_token_id": sp.id(sp.vision_start),
        "vision_end_token_id": sp.id(sp.vision_end),
    }


def _text(size: Size, sp: SpecialTokens, vocab: int, theta: float, section: list[int], **extra) -> dict:
    rope = {"rope_type": "default", "rope_theta": theta, "mrope_section": section, **extra}
    return {**text_fields(size, sp, vocab), "rope_parameters": rope}


def qwen2_vl(size: Size, sp: SpecialTokens, vocab: int):
    from transformers import Qwen2VLConfig

    t, v = size.text, size.vision
    if t.hidden != t.heads * t.head_dim:
        raise ValueError("Qwen2-VL derives head_dim from hidden / heads")
    vision = {
        "depth": v.layers,
        "embed_dim": v.hidden,
        "hidden_size": t.hidden,  # the merger's output width = the LM's width
        "mlp_ratio": v.intermediate // v.hidden,
        "num_heads": v.heads,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "initializer_range": size.initializer_range,
    }
    text = _text(size, sp, vocab, 1_000_000.0, _mrope_section(t.head_dim, interleaved=False))
    return Qwen2VLConfig(text_config=text, vision_config=vision, **_token_ids(sp), tie_word_embeddings=False)


def qwen2_5_vl(size: Size, sp: SpecialTokens, vocab: int):
    from transformers import Qwen2_5_VLConfig

    t, v = size.text, size.vision
    if t.hidden != t.heads * t.head_dim:
        raise ValueError("Qwen2.5-VL derives head_dim from hidden / heads")
    vision = {
        "depth": v.layers,
        "hidden_size": v.hidden,
        "intermediate_size": v.intermediate,
        "out_hidden_size": t.hidden,
        "num_heads": v.heads,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "window_size": 112,  # 4 x 4 merged tokens per attention window, as in the real model
        "fullatt_block_indexes": [v.layers - 1],
        "initializer_range": size.initializer_range,
    }
    text = _text(size, sp, vocab, 1_000_000.0, _mrope_section(t.head_dim, interleaved=False))
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, **_token_ids(sp), tie_word_embeddings=False)


def qwen3_vl(size: Size, sp: SpecialTokens, vocab: int):
    from transformers import Qwen3VLConfig

    t, v = size.text, size.vision
    depth = v.layers + 1  # one more layer than the others so that deepstack taps are not the last layer
    vision = {
        "depth": depth,
        "hidden_size": v.hidden,
        "intermediate_size": v.intermediate,
        "out_hidden_size": t.hidden,
        "num_heads": v.heads,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "num_position_embeddings": v.position_grid**2,
        # features of these ViT layers are added to the hidden states of the first LM layers
        "deepstack_visual_indexes": _deepstack_taps(depth, t.layers),
        "initializer_range": size.initializer_range,
    }
    text = _text(size, sp, vocab, 5_000_000.0, _mrope_section(t.head_dim, interleaved=True), mrope_interleaved=True)
    text.update(head_dim=t.head_dim)
    return Qwen3VLConfig(text_config=text, vision_config=vision, **_token_ids(sp), tie_word_embeddings=False)


# patch size of each family's ViT (the image processor must agree)
PATCH = {"qwen2_vl": 14, "qwen2_5_vl": 14, "qwen3_vl": 16}
BUILDERS = {"qwen2_vl": qwen2_vl, "qwen2_5_vl": qwen2_5_vl, "qwen3_vl": qwen3_vl}
