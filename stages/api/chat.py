"""From an OpenAI chat request to what the engine runs: HF chat-template messages, a ``Prompt`` and
``SamplingParams``.

A server takes images one way (``ImageMode``), set by its role:

    PIXELS  image_url parts, decoded and preprocessed here (colocated; prefill in PD mode)
    SIZES   image_url parts, read for their size from the file header only (decode in PD mode)
    REFS    image_ref parts ``{key, width, height}`` (prefill and decode in EPD mode, --redis-url)

The other kind of image part gets 400 naming the part. In SIZES and REFS modes the prompt is built
from sizes (``PromptBuilder.build_from_sizes``) and no pixel is touched; an EPD prefill then fills
the embeddings from the cache (``stages.disagg.embeddings``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Protocol

from jinja2 import TemplateError
from PIL import Image

from cache.image_bytes import INVALID_IMAGE, TOO_MANY_IMAGES
from cache.keys import image_key
from stages.api.errors import bad_request
from stages.api.images import ImageLimits, check_size, decode_data_url, header_size, open_image
from stages.api.schemas import MIN_TEMPERATURE, MIN_TOP_P, ChatCompletionRequest, ImageRef
from stages.engine.multimodal import Prompt
from stages.engine.sampling_params import SamplingParams


# The key under which a stage that takes pixels names its images for prefix caching. Those keys never
# leave the process (one engine, one model), so they need no model's vision fingerprint; in EPD mode
# the image_ref's key (the encoder's) is used instead.
LOCAL_FINGERPRINT = "0" * 64


class ImageMode(str, enum.Enum):
    PIXELS = "pixels"
    SIZES = "sizes"
    REFS = "refs"


class EngineLimits(Protocol):
    """What preparing a request needs of the engine (``AsyncEngine`` has it)."""

    @property
    def max_model_len(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    def check_request(self, prompt: Prompt, params: SamplingParams) -> None: ...


def image_parts(request: ChatCompletionRequest) -> list[tuple[Any, str]]:
    """Every image part (image_url or image_ref) and its ``param`` path, in conversation order."""
    return [(part, f"messages[{i}].content[{j}]")
            for i, message in enumerate(request.messages) if isinstance(message.content, list)
            for j, part in enumerate(message.content) if part.type != "text"]


def image_sources(request: ChatCompletionRequest) -> list[tuple[str, str]]:
    """Every image_url part's URL and its ``param`` path, in conversation order."""
    return [(part.url, f"{param}.image_url") for part, param in image_parts(request) if part.type == "image_url"]


def image_refs(request: ChatCompletionRequest) -> list[tuple[ImageRef, str]]:
    """Every image_ref part's reference and its ``param`` path, in conversation order."""
    return [(part.image_ref, f"{param}.image_ref") for part, param in image_parts(request) if part.type == "image_ref"]


def hf_messages(request: ChatCompletionRequest) -> list[dict]:
    """OpenAI messages -> chat-template messages; each image part becomes ``{"type": "image"}``."""
    messages = []
    for message in request.messages:
        parts = message.content
        content: str | list[dict[str, str | None]] = "" if parts is None else parts if isinstance(parts, str) else [
            {"type": "text", "text": part.text} if part.type == "text" else {"type": "image"} for part in parts]
        messages.append({"role": message.role, "content": content})
    return messages


def load_images(request: ChatCompletionRequest, limits: ImageLimits) -> list[tuple[Image.Image, str]]:
    """Decode every image, after checking how many there are (before decoding any); each with its
    content key (``cache.keys.image_key`` of its bytes under ``LOCAL_FINGERPRINT``)."""
    check_images(request, limits, ImageMode.PIXELS)
    images = []
    for url, param in image_sources(request):
        data = decode_data_url(url, limits, param)
        images.append((open_image(data, limits, param), image_key(data, LOCAL_FINGERPRINT)))
    return images


def image_sizes(request: ChatCompletionRequest, limits: ImageLimits,
                mode: ImageMode) -> list[tuple[tuple[int, int], str]]:
    """(width, height) of every image without decoding pixels, and its content key: from the file
    header and the bytes' key (SIZES, as ``load_images``) or from the reference (REFS). Checks the
    count and kinds first, and each size against the limits."""
    check_images(request, limits, mode)
    if mode is ImageMode.SIZES:
        sized = []
        for url, param in image_sources(request):
            data = decode_data_url(url, limits, param)
            sized.append((header_size(data, limits, param), image_key(data, LOCAL_FINGERPRINT)))
        return sized
    refs = []
    for ref, param in image_refs(request):
        check_size(ref.width, ref.height, limits, param)
        refs.append(((ref.width, ref.height), ref.key))
    return refs


def check_images(request: ChatCompletionRequest, limits: ImageLimits, mode: ImageMode) -> None:
    """400 if there are more images than ``--max-images-per-request``, or an image part of the kind
    this server does not take (named by its param)."""
    parts = image_parts(request)
    if len(parts) > limits.max_images:
        raise bad_request(f"The request has {len(parts)} images; this server accepts at most "
                          f"{limits.max_images} per request.", "messages", TOO_MANY_IMAGES)
    wanted = "image_ref" if mode is ImageMode.REFS else "image_url"
    wrong = next((param for part, param in parts if part.type != wanted), None)
    if wrong is not None and mode is ImageMode.REFS:
        raise bad_request("This server runs in EPD mode (--redis-url): it takes images only as image_ref parts "
                          '({"key", "width", "height"}) of images sent to an encoder, not as pixels.',
                          wrong, "image_url_not_supported")
    if wrong is not None:
        raise bad_request("image_ref parts are taken only by prefill and decode servers started with "
                          "--redis-url (EPD mode); send the image itself as an image_url data: URL.",
                          wrong, "image_ref_not_supported")


def sampling_params(request: ChatCompletionRequest, prompt_len: int, max_model_len: int,
                    vocab_size: int) -> SamplingParams:
    """The request's sampling, with the clamps its schema documents: ``max_completion_tokens`` wins over
    ``max_tokens`` (neither: what is left of the context); a sampled temperature below
    ``MIN_TEMPERATURE`` and a top_p below ``MIN_TOP_P`` are raised to them; a top_k of -1, or at or
    above the vocabulary size, disables top-k (0)."""
    max_tokens = request.max_completion_tokens or request.max_tokens or max(1, max_model_len - prompt_len)
    temperature = 1.0 if request.temperature is None else request.temperature
    top_k = request.top_k or 0
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=max(temperature, MIN_TEMPERATURE) if temperature > 0 else 0.0,
            top_p=1.0 if request.top_p is None else max(request.top_p, MIN_TOP_P),
            top_k=top_k if 0 < top_k < vocab_size else 0,
            seed=request.seed,
            stop=request.stop_strings,
            ignore_eos=bool(request.ignore_eos),
        )
    except ValueError as exc:
        raise bad_request(str(exc), None, "invalid_value") from None


@dataclass(frozen=True)
class Preparer:
    """A server's way from a request body to (prompt, sampling parameters): its prompt builder
    (``stages.prompt.PromptBuilder``: ``num_image_tokens`` to check each image's size, then ``build``
    for PIXELS, ``build_from_sizes`` otherwise), its
    engine's limits, its image limits and how it takes images."""

    prompts: Any
    engine: EngineLimits
    limits: ImageLimits
    mode: ImageMode

    def __call__(self, request: ChatCompletionRequest) -> tuple[Prompt, SamplingParams]:
        """Everything CPU-bound before a request can be queued (image decoding, preprocessing,
        tokenization); run it off the event loop. Raises APIError for anything the client got wrong."""
        engine, messages = self.engine, hf_messages(request)
        loaded = load_images(request, self.limits) if self.mode is ImageMode.PIXELS else None
        images = [image for image, _ in loaded] if loaded is not None else None
        keyed = [(image.size, key) for image, key in loaded] if loaded is not None else \
            image_sizes(request, self.limits, self.mode)
        sizes = [size for size, _ in keyed]
        self._check_sizes(request, sizes)
        try:
            prompt = self.prompts.build(messages, images) if images is not None else \
                self.prompts.build_from_sizes(messages, sizes)
        except (ValueError, TemplateError) as exc:  # PromptError, an image the processor refuses, a template error
            raise bad_request(f"The messages could not be turned into a prompt: {exc}", "messages",
                              "invalid_prompt") from None
        prompt.image_keys = [key for _, key in keyed]  # for prefix caching: each image's content key
        params = sampling_params(request, len(prompt.token_ids), engine.max_model_len, engine.vocab_size)
        try:
            engine.check_request(prompt, params)
        except ValueError as exc:
            too_long = len(prompt.token_ids) + params.max_tokens > engine.max_model_len
            raise bad_request(str(exc), "messages" if too_long else "max_tokens",
                              "context_length_exceeded" if too_long else "invalid_value") from None
        return prompt, params

    def _check_sizes(self, request: ChatCompletionRequest, sizes: list[tuple[int, int]]) -> None:
        """400 ``invalid_image`` naming the first image whose size the model's image processor refuses
        (an aspect ratio over 200 for Qwen-VL), before any is preprocessed."""
        for (width, height), (part, param) in zip(sizes, image_parts(request)):
            try:
                self.prompts.num_image_tokens(width, height)
            except ValueError as exc:
                raise bad_request(f"The image's size ({width}x{height}) is refused by this model's image "
                                  f"processor: {exc}", f"{param}.{part.type}", INVALID_IMAGE) from None
