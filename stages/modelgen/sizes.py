"""Size presets: `tiny` (a few MB, for tests) and `small` (~50M parameters, for benchmarks)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .specials import SpecialTokens


@dataclass(frozen=True)
class TextSize:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    tokenizer_vocab: int  # tokens the BPE trainer may learn, special tokens included
    min_config_vocab: int  # config vocab_size is at least this (and covers the tokenizer)
    max_positions: int

    def __post_init__(self) -> None:
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")


@dataclass(frozen=True)
class VisionSize:
    hidden: int
    layers: int
    heads: int
    intermediate: int
    min_image_tokens: int  # Qwen: bounds of the dynamic resolution, in merged (LLM) tokens per image
    max_image_tokens: int
    llava_image_size: int  # LLaVA: fixed square input; (size / patch)**2 tokens per image
    llava_patch: int
    position_grid: int  # Qwen3-VL: learned position embeddings cover a grid x grid patch map


@dataclass(frozen=True)
class Size:
    text: TextSize
    vision: VisionSize
    initializer_range: float = 0.05  # wider than the 0.02 default so greedy logits are rarely near-tied


PRESETS: dict[str, Size] = {
    "tiny": Size(
        text=TextSize(64, 2, 4, 2, 16, 128, tokenizer_vocab=1024, min_config_vocab=0, max_positions=2048),
        vision=VisionSize(32, 2, 2, 64, 4, 64, llava_image_size=56, llava_patch=14, position_grid=16),
    ),
    "small": Size(
        text=TextSize(512, 4, 8, 4, 64, 1408, tokenizer_vocab=32000, min_config_vocab=32000, max_positions=16384),
        vision=VisionSize(256, 4, 4, 1024, 4, 1024, llava_image_size=224, llava_patch=14, position_grid=32),
    ),
}


def config_vocab(size: TextSize, n_tokens: int, multiple: int = 64) -> int:
    need = max(n_tokens, size.min_config_vocab)
    return -(-need // multiple) * multiple


def text_fields(size: Size, sp: SpecialTokens, vocab: int) -> dict:
    """Config fields every generated language model shares (Qwen-VL text, Llama, Qwen2)."""
    t = size.text
    return {
        "vocab_size": vocab,
        "hidden_size": t.hidden,
        "intermediate_size": t.intermediate,
        "num_hidden_layers": t.layers,
        "num_attention_heads": t.heads,
        "num_key_value_heads": t.kv_heads,
        "max_position_embeddings": t.max_positions,
        "initializer_range": size.initializer_range,
        "bos_token_id": sp.id(sp.bos),
        "eos_token_id": sp.id(sp.eos),
        "pad_token_id": sp.id(sp.pad),
    }
