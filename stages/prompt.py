"""Chat template, tokenization and image-placeholder expansion, shared by every stage that builds a prompt.

The chat template writes one placeholder token per image; ``PromptBuilder`` preprocesses each
image with the model's image processor, works out how many tokens it fills (adapter rule), repeats
the placeholder that many times and tokenizes the whole string, exactly as the model's Hugging Face
processor does, so prompt ids match ``processor.apply_chat_template`` token for token.

``build_from_sizes`` gives the same token ids from each image's (width, height) alone: the count
follows from the processor config (``num_image_tokens``), so a stage that receives image references
(decode; prefill in EPD mode) never touches pixels. The builder reads only the adapter's config
rules, never its weights: an adapter of either half serves.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image

from stages.engine.models.base import ModelAdapter
from stages.engine.multimodal import ImageInput, Prompt


class PromptError(ValueError):
    """The conversation cannot be turned into a prompt (template or image mismatch)."""


def preprocess_image(image_processor: Any, adapter: ModelAdapter, image: Image.Image) -> ImageInput:
    """One image through the model's image processor: what the vision tower eats, and the number of
    placeholder tokens it fills (the adapter's rule on the processed pixels). Shared by the prompt
    builder and the encoder server. ValueError for an image the processor refuses."""
    out = image_processor(images=[image.convert("RGB")], return_tensors="pt")
    grid = out.get("image_grid_thw")
    if grid is not None:
        item = ImageInput(out["pixel_values"], tuple(int(x) for x in grid[0]), 0)
    else:
        item = ImageInput(out["pixel_values"][0], None, 0)
    return ImageInput(item.pixel_values, item.grid_thw, adapter.num_image_tokens(item))


@dataclass
class PromptBuilder:
    tokenizer: object
    image_processor: object
    adapter: ModelAdapter

    @classmethod
    def load(cls, model_dir: str | Path, adapter: ModelAdapter) -> PromptBuilder:
        """The checkpoint's tokenizer and image processor, with ``adapter``'s rules."""
        from transformers import AutoImageProcessor, AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(model_dir), AutoImageProcessor.from_pretrained(model_dir), adapter)

    @property
    def placeholder(self) -> str:
        return self.tokenizer.convert_ids_to_tokens(self.adapter.image_token_id)

    def preprocess(self, image: Image.Image) -> ImageInput:
        return preprocess_image(self.image_processor, self.adapter, image)

    def render(self, messages: list[dict]) -> str:
        """The chat template applied to HF-style messages (image parts are ``{"type": "image"}``)."""
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def num_image_tokens(self, width: int, height: int) -> int:
        """Placeholder tokens an image of ``width`` x ``height`` pixels fills, without its pixels.
        ValueError (e.g. an aspect ratio the processor refuses) exactly where ``preprocess`` fails."""
        if width <= 0 or height <= 0:
            raise ValueError(f"an image must be at least 1x1 pixels, got {width}x{height}")
        return self.adapter.num_image_tokens_for_size(width, height, self.image_processor)

    def build(self, messages: list[dict], images: list[Image.Image]) -> Prompt:
        """Token ids and preprocessed pixels (to encode here)."""
        inputs = [self.preprocess(image) for image in images]
        return Prompt(token_ids=self._token_ids(messages, [im.num_tokens for im in inputs]), images=inputs)

    def build_from_sizes(self, messages: list[dict], sizes: list[tuple[int, int]]) -> Prompt:
        """Token ids for images known only by (width, height); no pixels. The caller fills
        ``embeddings`` (encoded elsewhere) before the prompt is prefilled."""
        return Prompt(token_ids=self._token_ids(messages, [self.num_image_tokens(w, h) for w, h in sizes]))

    def _token_ids(self, messages: list[dict], counts: list[int]) -> list[int]:
        """The rendered conversation with image i's placeholder repeated ``counts[i]`` times, tokenized."""
        pieces = self.render(messages).split(self.placeholder)
        if len(pieces) - 1 != len(counts):
            raise PromptError(f"the chat template wrote {len(pieces) - 1} image placeholders for {len(counts)} images")
        text = pieces[0] + "".join(self.placeholder * count + piece for count, piece in zip(counts, pieces[1:]))
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]
