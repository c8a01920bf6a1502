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
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from PIL import Image

from contract.video import VideoPlan
from stages.chat_template import find_chat_template
from stages.engine.detokenizer import IncrementalDetokenizer, TextDecoding
from stages.engine.models.base import ModelAdapter, SizeRule
from stages.engine.multimodal import ImageInput, Prompt
from stages.generation_defaults import GenerationDefaults
from stages.text_bound import chars_per_token
from stages.video_preprocess import VideoConfig, VideoFrames, preprocess_video

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
    ``stages.loading`` as ``--generation-config`` says; ``stages.generation_defaults``). ``video``: the
    checkpoint's video processing (None: the family takes no video).

    A prompt's visual items are images and videos, in conversation order: an image is a PIL image
    (``build``) or its (width, height) (``build_from_sizes``), a video its decoded frames
    (``stages.video_preprocess.VideoFrames``) or its ``contract.video.VideoPlan``."""

    tokenizer: Any
    adapter: ModelAdapter
    sizes: SizeRule
    image_processor: Any | None
    guides: GuideCompiler | None = None
    defaults: GenerationDefaults = field(default_factory=GenerationDefaults)
    video: VideoConfig | None = None

    @classmethod
    def load(cls, model_dir: str | Path, adapter: ModelAdapter, *, pixels: bool = True,
             tokenizer: Any | None = None) -> PromptBuilder:
        """The checkpoint's tokenizer (unless given) and image processor config, with ``adapter``'s
        rules. With ``pixels=False`` the image processor is read for its size rule and not kept."""
        from transformers import AutoImageProcessor

        image_processor = AutoImageProcessor.from_pretrained(model_dir)
        rule = adapter.video_rule
        return cls(tokenizer if tokenizer is not None else load_tokenizer(model_dir), adapter,
                   adapter.size_rule(image_processor), image_processor if pixels else None,
                   video=VideoConfig.load(model_dir, rule) if rule is not None else None)

    @functools.cached_property
    def chars_per_token(self) -> int | None:
        """The most characters of input one token stands for (``stages.text_bound``); None if unbounded."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        return None if backend is None else chars_per_token(json.loads(backend.to_str()))

    @property
    def placeholder(self) -> str:
        return self.tokenizer.convert_ids_to_tokens(self.adapter.image_token_id)

    @property
    def video_placeholder(self) -> str | None:
        video = self.adapter.video_token_id
        return None if video is None else self.tokenizer.convert_ids_to_tokens(video)

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

    def build(self, messages: list[dict], items: list[Image.Image | VideoFrames],
              tools: list[dict] | None = None) -> Prompt:
        """Token ids and preprocessed pixels (to encode here); ``tools`` as ``render`` takes them."""
        if tools and not self.supports_tools:  # before any image is preprocessed
            raise ToolsNotSupported("this model's chat template has no tool format, so it cannot be given tools")
        inputs = [self.preprocess_item(item) for item in items]
        plans = [item.plan if isinstance(item, VideoFrames) else None for item in items]
        counts = [im.num_tokens for im in inputs]
        slots = [plan if plan is not None else count for plan, count in zip(plans, counts)]
        return Prompt(token_ids=self._token_ids(messages, slots, tools), image_tokens=counts, images=inputs,
                      videos=plans if any(plan is not None for plan in plans) else [])

    def build_from_sizes(self, messages: list[dict], sizes: list[tuple[int, int] | VideoPlan],
                         tools: list[dict] | None = None) -> Prompt:
        """Token ids for images known only by (width, height) and videos by their plans; no pixels. A
        prefill fills ``embeddings`` (encoded elsewhere) before the prompt is prefilled; a decode needs none."""
        slots: list[int | VideoPlan] = [size if isinstance(size, VideoPlan) else self.num_image_tokens(*size)
                                        for size in sizes]
        plans = [slot if isinstance(slot, VideoPlan) else None for slot in slots]
        return Prompt(token_ids=self._token_ids(messages, slots, tools),
                      image_tokens=[slot.num_tokens if isinstance(slot, VideoPlan) else slot for slot in slots],
                      videos=plans if any(plan is not None for plan in plans) else [])

    def preprocess_item(self, item: Image.Image | VideoFrames) -> ImageInput:
        """One visual item as ``build`` preprocesses it: an image through ``preprocess``, a video's
        decoded frames through the video processor. ValueError (PromptError) for what the processor refuses."""
        if not isinstance(item, VideoFrames):
            return self.preprocess(item)
        if self.video is None:
            raise PromptError(f"this {self.adapter.family} model takes no video")
        return preprocess_video(item.frames, item.plan, self.video)

    def _token_ids(self, messages: list[dict], slots: list[int | VideoPlan], tools: list[dict] | None = None) -> list[int]:
        """The rendered conversation with each image's placeholder repeated its count (an int of
        ``slots``) and each video's written out from its plan, tokenized."""
        text = self.render(messages, tools)
        video = self.video_placeholder
        marks = [self.placeholder] if video is None else [self.placeholder, video]
        if video is not None and self.adapter.timestamped_video:  # the template's wrapper: the frames bring their own
            text = text.replace(self._wrapped(video), video)
        pieces = re.split("(" + "|".join(map(re.escape, marks)) + ")", text)
        found = pieces[1::2]
        wanted = [self.placeholder if isinstance(slot, int) else video for slot in slots]
        if found != wanted:
            images = (found.count(self.placeholder), wanted.count(self.placeholder))
            videos = (len(found) - images[0], len(wanted) - images[1])
            raise PromptError(f"the chat template wrote {images[0]} image placeholders for {images[1]} images"
                              + (f" and {videos[0]} video placeholders for {videos[1]} videos" if any(videos) else "")
                              + (", in another order" if images[0] == images[1] and videos[0] == videos[1] else ""))
        text = pieces[0] + "".join(self._expand(slot) + piece for slot, piece in zip(slots, pieces[2::2]))
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _expand(self, slot: int | VideoPlan) -> str:
        """One item's placeholder text: an image's token ``slot`` times; a video's tokens, frame by frame
        after ``<t seconds>`` where the family writes timestamps (Qwen3-VL's processor)."""
        if isinstance(slot, int):
            return self.placeholder * slot
        video = self.video_placeholder
        assert video is not None  # a plan reaches here only through a template that wrote a video placeholder
        if not self.adapter.timestamped_video:
            return video * slot.num_tokens
        return "".join(f"<{time:.1f} seconds>" + self._wrapped(video * slot.frame_tokens) for time in slot.timestamps)

    def _wrapped(self, text: str) -> str:
        config = self.adapter.config
        start, end = (self.tokenizer.convert_ids_to_tokens(config.vision_start_token_id),
                      self.tokenizer.convert_ids_to_tokens(config.vision_end_token_id))
        return start + text + end


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
