"""Chat template, tokenization and image-placeholder expansion, shared by every stage that builds a prompt.

The chat template writes one placeholder token per image; ``PromptBuilder`` preprocesses each
image with the model's image processor, works out how many tokens it fills (adapter rule), repeats
the placeholder that many times and tokenizes the whole string, exactly as the model's Hugging Face
processor does, so prompt ids match ``processor.apply_chat_template`` token for token.

``build_from_sizes`` gives the same token ids from each image's (width, height) alone: the count
follows from the processor config (the adapter's ``SizeRule``), so a stage that receives image
references or only needs counts (decode; prefill in EPD mode) never touches pixels: its builder is
loaded with ``pixels=False`` and holds no image processor at all. The builder reads only the
adapter's config rules, never its weights: an adapter of either half serves.

Tools (OpenAI ``tools``, in the template's own shape: ``stages.api.tools.template_tools``) are
rendered by the chat template like any message; a template that writes nothing of them has no tool
format, and a request with tools is then refused (``ToolsNotSupported``) rather than silently
answered without them.

The engine never loads or holds a tokenizer: ``text_decoding`` gives it what it needs of the
builder's (detokenizers and end-of-sequence ids); ``stages.loading`` composes the two, and gives
the builder its ``guides`` (``stages.guided.GuideCompiler``: structured output over the same tokens).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from PIL import Image

from stages.chat_template import find_chat_template
from stages.engine.detokenizer import IncrementalDetokenizer, TextDecoding
from stages.engine.models.base import ModelAdapter, SizeRule
from stages.engine.multimodal import ImageInput, Prompt
from stages.generation_defaults import GenerationDefaults
from stages.text_bound import chars_per_token

if TYPE_CHECKING:
    from stages.guided import GuideCompiler

# A tool only a template that renders tools writes into the prompt (``PromptBuilder.supports_tools``)
_PROBE_NAME = "probe_tool_3f9c1e"
_PROBE_TOOL = {"type": "function", "function": {"name": _PROBE_NAME, "description": "probe",
                                                "parameters": {"type": "object", "properties": {}}}}


class PromptError(ValueError):
    """The conversation cannot be turned into a prompt (template or image mismatch)."""


class ToolsNotSupported(PromptError):
    """The request offers tools and the model's chat template has no tool format (the API's 400
    ``tools_not_supported``)."""


def preprocess_image(image_processor: Any, adapter: ModelAdapter, image: Image.Image) -> ImageInput:
    """One image through the model's image processor: what the vision tower eats, and the number of
    placeholder tokens it fills (the adapter's rule on the processed pixels). Shared by the prompt
    builder and the encoder server. ValueError for an image the processor refuses."""
    out = image_processor(images=[image.convert("RGB")], return_tensors="pt")
    grid = out.get("image_grid_thw")
    if grid is not None:
        t, h, w = (int(x) for x in grid[0])
        item = ImageInput(out["pixel_values"], (t, h, w), 0)
    else:
        item = ImageInput(out["pixel_values"][0], None, 0)
    return ImageInput(item.pixel_values, item.grid_thw, adapter.num_image_tokens(item))


@dataclass
class PromptBuilder:
    """``tokenizer``: the checkpoint's. ``adapter``: the family's rules (either half). ``sizes``: the
    processor config's size rule. ``image_processor``: for pixels; None on a stage that builds
    prompts from sizes only (then ``build``/``preprocess`` raise). ``guides``: compiles structured
    output for this tokenizer (set by ``stages.loading``; None where nothing compiles grammars).
    ``defaults``: the checkpoint's sampling defaults for the fields a request leaves out (set by
    ``stages.loading`` as ``--generation-config`` says; ``stages.generation_defaults``)."""

    tokenizer: Any
    adapter: ModelAdapter
    sizes: SizeRule
    image_processor: Any | None
    guides: GuideCompiler | None = None
    defaults: GenerationDefaults = field(default_factory=GenerationDefaults)

    @classmethod
    def load(cls, model_dir: str | Path, adapter: ModelAdapter, *, pixels: bool = True,
             tokenizer: Any | None = None) -> PromptBuilder:
        """The checkpoint's tokenizer (unless given) and image processor config, with ``adapter``'s
        rules. With ``pixels=False`` the image processor is read for its size rule and not kept."""
        from transformers import AutoImageProcessor

        image_processor = AutoImageProcessor.from_pretrained(model_dir)
        return cls(tokenizer if tokenizer is not None else load_tokenizer(model_dir), adapter,
                   adapter.size_rule(image_processor), image_processor if pixels else None)

    @functools.cached_property
    def chars_per_token(self) -> int | None:
        """The most characters of input one token stands for (``stages.text_bound``); None if unbounded."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        return None if backend is None else chars_per_token(json.loads(backend.to_str()))

    @property
    def placeholder(self) -> str:
        return self.tokenizer.convert_ids_to_tokens(self.adapter.image_token_id)

    def preprocess(self, image: Image.Image) -> ImageInput:
        if self.image_processor is None:
            raise RuntimeError("this prompt builder was loaded without an image processor (pixels=False): "
                               "it builds prompts from image sizes only")
        return preprocess_image(self.image_processor, self.adapter, image)

    def render(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        """The chat template applied to HF-style messages (image parts are ``{"type": "image"}``) and,
        if any, ``tools`` (ToolsNotSupported if the template has no tool format)."""
        if tools and not self.supports_tools:
            raise ToolsNotSupported("this model's chat template has no tool format, so it cannot be given tools")
        return self.tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                                  add_generation_prompt=True)

    @functools.cached_property
    def supports_tools(self) -> bool:
        """Whether the chat template renders tools: a probe tool's name shows in what it writes."""
        probe = [{"role": "user", "content": "hi"}]
        try:
            text = self.tokenizer.apply_chat_template(probe, tools=[_PROBE_TOOL], tokenize=False,
                                                      add_generation_prompt=True)
        except Exception:  # a template that breaks on tools has no tool format either
            return False
        return _PROBE_NAME in text

    def num_image_tokens(self, width: int, height: int) -> int:
        """Placeholder tokens an image of ``width`` x ``height`` pixels fills, without its pixels.
        ValueError (e.g. an aspect ratio the processor refuses) exactly where ``preprocess`` fails."""
        _check_size(width, height)
        return self.sizes.num_tokens(width, height)

    def image_grid(self, width: int, height: int) -> tuple[int, int, int] | None:
        """The ``grid_thw`` such an image gets (None for families without one); ValueError as above."""
        _check_size(width, height)
        return self.sizes.grid(width, height)

    def build(self, messages: list[dict], images: list[Image.Image], tools: list[dict] | None = None) -> Prompt:
        """Token ids and preprocessed pixels (to encode here); ``tools`` as ``render`` takes them."""
        if tools and not self.supports_tools:  # before any image is preprocessed
            raise ToolsNotSupported("this model's chat template has no tool format, so it cannot be given tools")
        inputs = [self.preprocess(image) for image in images]
        counts = [im.num_tokens for im in inputs]
        return Prompt(token_ids=self._token_ids(messages, counts, tools), image_tokens=counts, images=inputs)

    def build_from_sizes(self, messages: list[dict], sizes: list[tuple[int, int]],
                         tools: list[dict] | None = None) -> Prompt:
        """Token ids for images known only by (width, height); no pixels. A prefill fills
        ``embeddings`` (encoded elsewhere) before the prompt is prefilled; a decode needs none."""
        counts = [self.num_image_tokens(w, h) for w, h in sizes]
        return Prompt(token_ids=self._token_ids(messages, counts, tools), image_tokens=counts)

    def _token_ids(self, messages: list[dict], counts: list[int], tools: list[dict] | None = None) -> list[int]:
        """The rendered conversation with image i's placeholder repeated ``counts[i]`` times, tokenized."""
        pieces = self.render(messages, tools).split(self.placeholder)
        if len(pieces) - 1 != len(counts):
            raise PromptError(f"the chat template wrote {len(pieces) - 1} image placeholders for {len(counts)} images")
        text = pieces[0] + "".join(self.placeholder * count + piece for count, piece in zip(counts, pieces[1:]))
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]


def _check_size(width: int, height: int) -> None:
    if width <= 0 or height <= 0:
        raise ValueError(f"an image must be at least 1x1 pixels, got {width}x{height}")


def load_tokenizer(model_dir: str | Path) -> Any:
    """The checkpoint's tokenizer with its chat template, wherever the checkpoint keeps it: the
    tokenizer reads ``chat_template.jinja`` and ``tokenizer_config.json`` itself; a template only in
    ``chat_template.json`` (the processor's file, as Qwen2-VL, Qwen2.5-VL and LLaVA-1.5 ship it) is
    set from there (``stages.chat_template``)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if not tokenizer.chat_template and (found := find_chat_template(model_dir)) is not None:
        tokenizer.chat_template = found[1]
    return tokenizer


def text_decoding(model_dir: str | Path, tokenizer: Any) -> TextDecoding:
    """What an engine needs of ``tokenizer``: a detokenizer per request, and the end-of-sequence ids
    (the generation config's, else the tokenizer's)."""
    return TextDecoding(functools.partial(IncrementalDetokenizer, tokenizer), _eos_ids(model_dir, tokenizer))


def _eos_ids(model_dir: str | Path, tokenizer: Any) -> frozenset[int]:
    from transformers import GenerationConfig

    try:
        eos = GenerationConfig.from_pretrained(model_dir).eos_token_id
    except OSError:
        eos = None
    if eos is None:
        eos = tokenizer.eos_token_id
    return frozenset([eos] if isinstance(eos, int) else (eos or []))
