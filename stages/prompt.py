"""Chat template, tokenization and image-placeholder expansion, shared by every stage that builds a prompt.

The chat template writes one placeholder token per image; ``PromptBuilder`` preprocesses each
image with the model's image processor, works out how many tokens it fills (adapter rule), repeats
the placeholder that many times and tokenizes the whole string, exactly as the model's Hugging Face
processor does, so prompt ids match ``processor.apply_chat_template`` token for token.
"""

from __future__ import annotations

from dataclasses import dataclass

from PIL import Image

from stages.engine.models.base import ModelAdapter
from stages.engine.multimodal import ImageInput, Prompt


class PromptError(ValueError):
    """The conversation cannot be turned into a prompt (template or image mismatch)."""


@dataclass
class PromptBuilder:
    tokenizer: object
    image_processor: object
    adapter: ModelAdapter

    @property
    def placeholder(self) -> str:
        return self.tokenizer.convert_ids_to_tokens(self.adapter.image_token_id)

    def preprocess(self, image: Image.Image) -> ImageInput:
        out = self.image_processor(images=[image.convert("RGB")], return_tensors="pt")
        grid = out.get("image_grid_thw")
        if grid is not None:
            item = ImageInput(out["pixel_values"], tuple(int(x) for x in grid[0]), 0)
        else:
            item = ImageInput(out["pixel_values"][0], None, 0)
        return ImageInput(item.pixel_values, item.grid_thw, self.adapter.num_image_tokens(item))

    def render(self, messages: list[dict]) -> str:
        """The chat template applied to HF-style messages (image parts are ``{"type": "image"}``)."""
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def build(self, messages: list[dict], images: list[Image.Image]) -> Prompt:
        inputs = [self.preprocess(image) for image in images]
        pieces = self.render(messages).split(self.placeholder)
        if len(pieces) - 1 != len(inputs):
            raise PromptError(f"the chat template wrote {len(pieces) - 1} image placeholders for {len(inputs)} images")
        text = pieces[0] + "".join(self.placeholder * im.num_tokens + piece for im, piece in zip(inputs, pieces[1:]))
        token_ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return Prompt(token_ids=token_ids, images=inputs)
