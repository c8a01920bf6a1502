"""From an OpenAI chat request to what the engine runs: HF chat-template messages and PIL images
(in the order the template writes their placeholders), a ``Prompt`` and ``SamplingParams``."""

from __future__ import annotations

from jinja2 import TemplateError
from PIL import Image

from stages.api.errors import bad_request
from stages.api.images import ImageLimits, load_image
from stages.api.schemas import MIN_TEMPERATURE, MIN_TOP_P, ChatCompletionRequest
from stages.engine.engine import Engine
from stages.engine.multimodal import Prompt
from stages.engine.sampling_params import SamplingParams


def image_sources(request: ChatCompletionRequest) -> list[tuple[str, str]]:
    """Every image part's URL and its ``param`` path, in conversation order."""
    return [(part.url, f"messages[{i}].content[{j}].image_url")
            for i, message in enumerate(request.messages) if isinstance(message.content, list)
            for j, part in enumerate(message.content) if part.type == "image_url"]


def hf_messages(request: ChatCompletionRequest) -> list[dict]:
    """OpenAI messages -> chat-template messages; each image part becomes ``{"type": "image"}``."""
    messages = []
    for message in request.messages:
        content = message.content
        if isinstance(content, list):
            content = [{"type": "text", "text": part.text} if part.type == "text" else {"type": "image"}
                       for part in content]
        messages.append({"role": message.role, "content": content if content is not None else ""})
    return messages


def load_images(request: ChatCompletionRequest, limits: ImageLimits) -> list[Image.Image]:
    """Decode every image, after checking how many there are (before decoding any)."""
    sources = image_sources(request)
    if len(sources) > limits.max_images:
        raise bad_request(f"The request has {len(sources)} images; this server accepts at most "
                          f"{limits.max_images} per request.", "messages", "too_many_images")
    return [load_image(url, limits, param) for url, param in sources]


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
        raise bad_request(str(exc)) from None


def prepare(engine: Engine, request: ChatCompletionRequest, limits: ImageLimits) -> tuple[Prompt, SamplingParams]:
    """Everything CPU-bound before a request can be queued (image decoding, preprocessing,
    tokenization); run it off the event loop. Raises APIError for anything the client got wrong."""
    images = load_images(request, limits)
    try:
        prompt = engine.prompts.build(hf_messages(request), images)
    except (ValueError, TemplateError) as exc:  # PromptError, an image the processor refuses, a template error
        raise bad_request(f"The messages could not be turned into a prompt: {exc}", "messages") from None
    params = sampling_params(request, len(prompt.token_ids), engine.max_model_len, engine.vocab_size)
    try:
        engine.check_request(prompt, params)
    except ValueError as exc:
        too_long = len(prompt.token_ids) + params.max_tokens > engine.max_model_len
        raise bad_request(str(exc), "messages" if too_long else "max_tokens",
                          "context_length_exceeded" if too_long else None) from None
    return prompt, params
