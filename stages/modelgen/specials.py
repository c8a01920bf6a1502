"""The special tokens of each family and the role each one plays.

The tokenizer trainer puts special tokens first, so their ids are their positions in `tokens` whatever the
corpus: the model config can be written from this table alone. The random model never generates a special
token other than `eos` (see `build.mute`).
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class SpecialTokens:
    tokens: tuple[str, ...]
    eos: str  # ends an assistant turn; generation stops here
    pad: str
    bos: str | None = None  # written by the chat template, never added by the tokenizer
    unk: str | None = None
    image: str = "<|image_pad|>"
    video: str | None = None
    vision_start: str | None = None
    vision_end: str | None = None
    stop: tuple[str, ...] = ()  # further end tokens for generation_config.eos_token_id

    def id(self, token: str | None) -> int:
        """The id of ``token``; ValueError if it is None (this family has no such token) or not in ``tokens``."""
        if token is None:
            raise ValueError("this family has no such special token")
        return self.tokens.index(token)

    @property
    def eos_ids(self) -> list[int]:
        return [self.id(t) for t in (self.eos, *self.stop)]


QWEN = SpecialTokens(
    tokens=(
        "<|endoftext|>",
        "<|im_start|>",
        "<|im_end|>",
        "<|vision_start|>",
        "<|vision_end|>",
        "<|image_pad|>",
        "<|video_pad|>",
    ),
    eos="<|im_end|>",
    pad="<|endoftext|>",
    bos="<|endoftext|>",
    image="<|image_pad|>",
    video="<|video_pad|>",
    vision_start="<|vision_start|>",
    vision_end="<|vision_end|>",
    stop=("<|endoftext|>",),
)

LLAVA_LLAMA = SpecialTokens(
    tokens=("<unk>", "<s>", "</s>", "<pad>", "<image>"),
    eos="</s>",
    pad="<pad>",
    bos="<s>",
    unk="<unk>",
    image="<image>",
)

LLAVA_QWEN2 = SpecialTokens(
    tokens=("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<image>"),
    eos="<|im_end|>",
    pad="<|endoftext|>",
    bos="<|endoftext|>",
    image="<image>",
    stop=("<|endoftext|>",),
)
