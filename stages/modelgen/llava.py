"""Hugging Face config for LLaVA: a CLIP or SigLIP ViT, a 2-layer MLP projector, a Llama or Qwen2 LM."""

from .sizes import Size, text_fields
from .specials import SpecialTokens

VISION_TOWERS = ("clip", "siglip")
TEXT_MODELS = ("llama", "qwen2")


def _vision(size: Size, tower: str) -> dict:
    v = size.vision
    common = {
        "hidden_size": v.hidden,
        "intermediate_size": v.intermediate,
        "num_hidden_layers": v.layers,
        "num_attention_heads": v.heads,
        "image_size": v.llava_image_size,
        "patch_size": v.llava_patch,
        "initializer_range": size.initializer_range,
    }
    if tower == "clip":
        return {"model_type": "clip_vision_model", "projection_dim": v.hidden, **common}
    # LLaVA reads hidden states, so SigLIP's attention-pooling head would be dead weight
    return {"model_type": "siglip_vision_model", "vision_use_head": False, **common}


def _text(size: Size, sp: SpecialTokens, vocab: int, lm: str) -> dict:
    t = size.text
    common = {"model_type": lm, **text_fields(size, sp, vocab), "tie_word_embeddings": False}
    if lm == "llama":
        return {**common, "head_dim": t.head_dim, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
    if t.hidden != t.heads * t.head_dim:
        raise ValueError("Qwen2 derives head_dim from hidden / heads")
    return {**common, "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0}}


def image_tokens(size: Size) -> int:
    """Tokens per image: one per patch (CLIP's class token is dropped, SigLIP has none)."""
    return (size.vision.llava_image_size // size.vision.llava_patch) ** 2


def config(size: Size, sp: SpecialTokens, vocab: int, tower: str, lm: str):
    from transformers import LlavaConfig

    if tower not in VISION_TOWERS or lm not in TEXT_MODELS:
        raise ValueError(f"--vision must be one of {VISION_TOWERS} and --text one of {TEXT_MODELS}")
    return LlavaConfig(
        vision_config=_vision(size, tower),
        text_config=_text(size, sp, vocab, lm),
        image_token_index=sp.id(sp.image),
        image_seq_length=image_tokens(size),
        projector_hidden_act="gelu",
        # CLIP: drop the class token, read the second-to-last layer (LLaVA-1.5);
        # SigLIP: keep every patch, read the last layer (LLaVA-OneVision)
        vision_feature_select_strategy="default" if tower == "clip" else "full",
        vision_feature_layer=-2 if tower == "clip" else -1,
        tie_word_embeddings=False,
    )
