"""From an OpenAI chat request to what the engine runs: HF chat-template messages, a ``Prompt`` and
``SamplingParams``.

A server takes images one way (``ImageMode``), set by its role:

    PIXELS  image_url parts, decoded and preprocessed here (colocated; prefill in PD mode), except an
            image the engine's prefix cache covers (below)
    SIZES   image_url parts, read for their size from the file header only (decode in PD mode)
    REFS    image_ref parts ``{key, width, height}`` (prefill and decode in EPD mode, --redis-url)

Videos likewise: ``video_url`` parts decoded here (PIXELS: only the planned frames), read for their
plan from the header and packets (SIZES), or ``video_ref`` parts (REFS); a model that takes no video
answers any video part 400 ``video_not_supported``. Images and videos are the prompt's items in
conversation order (``stages.engine.multimodal.Prompt``).

The other kind of image (or video) part gets 400 naming the part. In SIZES and REFS modes the prompt is built
from sizes (``PromptBuilder.build_from_sizes``) and no pixel is touched; an EPD prefill then fills
the embeddings from the cache (``stages.disagg.embeddings``).

In PIXELS mode the prompt is built from sizes too (each image read as far as its header: the same
token ids as its pixels would give), then each image is decoded and preprocessed, except one whose
placeholders lie wholly in the prefix the engine's cache holds now (``EngineLimits.prefix_hint``): its
KV is there, so it stays an ``ImageInput.deferred`` holding its bytes, and the engine makes its pixels
only if the hint went stale (``stages.engine.image_encoding``). Counted in
``epd_images_preprocess_skipped_total``. Such an image cannot be one a full decode would refuse: its
content key is its bytes' hash, and the cached blocks that cover it were computed from those very
bytes, decoded and encoded by this stage (or by the prefill that sent a decode its KV).
"""

from __future__ import annotations

import enum
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from jinja2 import TemplateError

from cache.keys import image_key, video_key
from contract.errors import Code
from contract.video import VideoPlan, VideoSampling, check_resolved
from stages.api import videos
from stages.api.errors import APIError, bad_request
from stages.api.images import ImageLimits, check_size, decode_data_url, header_size, open_image
from stages.api.sampling import NO_DEFAULTS, with_defaults
from stages.api.sampling import sampling_params as shared_sampling_params
from stages.api.message_schemas import ImageRef, VideoRef
from stages.api.schemas import ChatCompletionRequest
from stages.api.tools import forced_tool_schema, template_tool_calls, template_tools, tool_content
from stages.engine.guide import Guide
from stages.engine.multimodal import ImageInput, Prompt
from stages.engine.prefix_cache import covered_items
from stages.engine.sampling_params import SamplingParams
from stages.generation_defaults import GenerationDefaults
from stages.config import VideoLimits
from stages.prompt import ToolsNotSupported
from stages.video_preprocess import VideoFrames

if TYPE_CHECKING:
    from stages.guided import GuideCompiler


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

    def prefix_hint(self, prompt: Prompt) -> int: ...


def image_parts(request: ChatCompletionRequest) -> list[tuple[Any, str]]:
    """Every image or video part (image_url, image_ref, video_url, video_ref) and its ``param`` path, in
    conversation order: the prompt's items."""
    return [(part, f"messages[{i}].content[{j}]")
            for i, message in enumerate(request.messages) if isinstance(message.content, list)
            for j, part in enumerate(message.content) if part.type != "text"]


def image_sources(request: ChatCompletionRequest) -> list[tuple[str, str]]:
    """Every image_url part's URL and its ``param`` path, in conversation order."""
    return [(part.url, f"{param}.image_url") for part, param in image_parts(request) if part.type == "image_url"]


def image_refs(request: ChatCompletionRequest) -> list[tuple[ImageRef | VideoRef, str]]:
    """Every image_ref and video_ref part's reference and its ``param`` path, in conversation order."""
    return [(part.image_ref or part.video_ref, f"{param}.{part.type}") for part, param in image_parts(request)
            if part.type in ("image_ref", "video_ref")]


def video_parts(request: ChatCompletionRequest) -> list[tuple[Any, str]]:
    """Every video part (video_url or video_ref) and its ``param`` path (``...content[j].video_url``)."""
    return [(part, f"{param}.{part.type}") for part, param in image_parts(request) if part.is_video]


def hf_messages(request: ChatCompletionRequest) -> list[dict]:
    """OpenAI messages -> chat-template messages; each image part becomes ``{"type": "image"}``, each video
    part ``{"type": "video"}``; an
    assistant's tool calls and a tool message's text as templates take them (``stages.api.tools``).
    400 naming the call whose arguments are not a JSON object."""
    messages = []
    for i, message in enumerate(request.messages):
        parts = message.content
        if message.role == "tool":
            messages.append({"role": "tool", "content": tool_content(
                parts if parts is None or isinstance(parts, str) else [{"text": part.text} for part in parts]),
                "tool_call_id": message.tool_call_id})
            continue
        content: str | list[dict[str, str | None]] = "" if parts is None else parts if isinstance(parts, str) else [
            {"type": "text", "text": part.text} if part.type == "text" else
            {"type": "video"} if part.is_video else {"type": "image"} for part in parts]
        hf: dict[str, Any] = {"role": message.role, "content": content}
        if message.tool_calls:
            try:
                hf["tool_calls"] = template_tool_calls([call.model_dump() for call in message.tool_calls])
            except ValueError as exc:
                raise bad_request(f"Invalid value for 'messages[{i}]': {exc}", f"messages[{i}].tool_calls",
                                  Code.INVALID_VALUE) from None
        messages.append(hf)
    return messages


def guide(request: ChatCompletionRequest, guides: GuideCompiler | None) -> Guide | None:
    """The grammar every choice of ``request`` follows, compiled by ``guides`` (a
    ``stages.guided.GuideCompiler``): a forced tool call's schema (``tool_choice`` required or a
    named function), or ``response_format``'s (None for text). 400 ``invalid_tool_schema`` /
    ``invalid_response_format`` for a schema the compiler refuses; 400 ``structured_output_unavailable``
    if the server has no compiler (``guides`` None) and the request needs one."""
    response_format = request.response_format
    forced = request.forces_tool
    if not forced and (response_format is None or response_format.type == "text"):
        return None
    if guides is None:
        raise bad_request("This server cannot constrain its output (no grammar compiler).",
                          "tool_choice" if forced else "response_format", "structured_output_unavailable")
    if forced:
        try:
            schema = forced_tool_schema([tool.model_dump() for tool in request.tools or ()], request.tool_choice_json)
            assert schema is not None  # required or a named function: there is a call to force
            return guides.compile_schema(schema)
        except ValueError as exc:
            raise bad_request(f"The tools' parameters cannot be enforced for tool_choice: {exc}", "tools",
                              "invalid_tool_schema") from None
    assert response_format is not None  # not forced: a response format asked for a grammar
    try:
        return guides.compile_response_format(response_format.model_dump(by_alias=True, exclude_none=True))
    except ValueError as exc:
        raise bad_request(f"Invalid value for 'response_format': {exc}", "response_format",
                          "invalid_response_format") from None


@dataclass(frozen=True)
class ReadImage:
    """One image_url image read as far as its header: its bytes, its (width, height), its content key
    (``cache.keys.image_key`` of its bytes under ``LOCAL_FINGERPRINT``) and the ``param`` naming its part."""

    data: bytes
    size: tuple[int, int]
    key: str
    param: str


def read_images(request: ChatCompletionRequest, limits: ImageLimits) -> list[ReadImage]:
    """Every image_url image read as far as its header, after checking how many there are (before
    reading any): no pixel decoded (``make_image`` decodes one; a file broken past its header is its
    400)."""
    check_images(request, limits, ImageMode.PIXELS)
    read = []
    for url, param in image_sources(request):
        data = decode_data_url(url, limits, param)
        read.append(ReadImage(data, header_size(data, limits, param), image_key(data, LOCAL_FINGERPRINT), param))
    return read


def make_image(prompts: Any, limits: ImageLimits, image: ReadImage) -> ImageInput:
    """A read image decoded (APIError 400 ``invalid_image`` for a file broken past its header) and
    preprocessed by ``prompts`` (a ``PromptBuilder``; ValueError for what its processor refuses)."""
    return prompts.preprocess_item(open_image(image.data, limits, image.param))


def image_sizes(request: ChatCompletionRequest, limits: ImageLimits,
                mode: ImageMode) -> list[tuple[tuple[int, int], str]]:
    """(width, height) of every image without decoding pixels, and its content key: from the file
    header and the bytes' key (SIZES: ``read_images``) or from the reference (REFS). Checks the
    count and kinds first, and each size against the limits."""
    if mode is not ImageMode.REFS:
        return [(image.size, image.key) for image in read_images(request, limits)]
    check_images(request, limits, mode)
    refs = []
    for part, param in image_parts(request):
        if part.type != "image_ref":
            continue  # an image_url is refused by check_images; a video_ref is Preparer._videos's
        ref = part.image_ref
        check_size(ref.width, ref.height, limits, f"{param}.image_ref")
        refs.append(((ref.width, ref.height), ref.key))
    return refs


def check_images(request: ChatCompletionRequest, limits: ImageLimits, mode: ImageMode) -> None:
    """400 if there are more images than ``--max-images-per-request``, or an image part of the kind
    this server does not take (named by its param)."""
    parts = [(part, param) for part, param in image_parts(request) if not part.is_video]
    if len(parts) > limits.max_images:
        raise bad_request(f"The request has {len(parts)} images; this server accepts at most "
                          f"{limits.max_images} per request.", "messages", Code.TOO_MANY_IMAGES)
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
                    vocab_size: int, guide: Guide | None = None,
                    defaults: GenerationDefaults = NO_DEFAULTS) -> SamplingParams:
    """The request's sampling (``stages.api.sampling``, with the checkpoint's ``defaults`` for the
    fields it leaves out): ``max_completion_tokens`` wins over ``max_tokens`` (neither: what is left of
    the context, or the checkpoint's ``max_new_tokens`` if fewer); ``logprobs`` true asks for
    ``top_logprobs`` (default 0) alternatives per token."""
    left = max(1, max_model_len - prompt_len)
    max_tokens = request.max_completion_tokens or request.max_tokens or min(left, defaults.max_tokens or left)
    return shared_sampling_params(with_defaults(request, defaults), vocab_size, max_tokens=max_tokens, guide=guide,
                                  logprobs=(request.top_logprobs or 0) if request.logprobs else None)


@dataclass(frozen=True)
class PlannedVideo:
    """One video of a request, read as far as its plan: its content key, and its bytes (b"" for a reference)."""

    plan: VideoPlan
    key: str
    data: bytes
    param: str  # messages[i].content[j].video_url


def _in_order(is_video: list[bool], images: list, videos_: list) -> list:
    """The images' and the videos' values merged in the order of their parts (``is_video``, one per part
    in conversation order)."""
    image_values, video_values = iter(images), iter(videos_)
    return [next(video_values) if video else next(image_values) for video in is_video]


@dataclass(frozen=True)
class Preparer:
    """A server's way from a request body to (prompt, sampling parameters): its prompt builder
    (``stages.prompt.PromptBuilder``: ``num_image_tokens`` to check each image's size, then
    ``build_from_sizes``, and for PIXELS ``image_grid`` and ``preprocess_item`` for each item's pixels,
    its ``guides`` to compile a request's grammar and its ``defaults``, the checkpoint's sampling
    defaults), its engine's limits (and prefix hint), its image limits and how it takes images."""

    prompts: Any
    engine: EngineLimits
    limits: ImageLimits
    mode: ImageMode
    video: VideoLimits = VideoLimits()
    # Metrics.observe_video_decode: each video read here (frames decoded, seconds, bytes); any thread
    observe_decode: Callable[[int, float, int], None] | None = None
    # Metrics.images_preprocess_skipped.inc: a request's images left deferred (PIXELS); any thread
    observe_skipped: Callable[[int], None] | None = None

    def __call__(self, request: ChatCompletionRequest) -> tuple[Prompt, SamplingParams]:
        """Everything CPU-bound before a request can be queued (image and video decoding, preprocessing,
        tokenization, compiling its grammar); run it off the event loop. Raises APIError for anything
        the client got wrong."""
        engine, messages = self.engine, hf_messages(request)
        planned = self._videos(request)  # counted, probed and planned: no frame decoded yet
        read = read_images(request, self.limits) if self.mode is ImageMode.PIXELS else None
        keyed = [(image.size, image.key) for image in read] if read is not None else \
            image_sizes(request, self.limits, self.mode)
        self._check_sizes(request, [size for size, _ in keyed])
        order = [part.is_video for part, _ in image_parts(request)]
        sizes = _in_order(order, [size for size, _ in keyed], [video.plan for video in planned])
        prompt = self._build(request, messages, sizes)
        # for prefix caching: each image's and video's content key
        prompt.image_keys = _in_order(order, [key for _, key in keyed], [video.key for video in planned])
        if read is not None:
            self._fill_pixels(prompt, _in_order(order, read, planned))
        params = sampling_params(request, len(prompt.token_ids), engine.max_model_len, engine.vocab_size,
                                 guide(request, self.prompts.guides), self.prompts.defaults)
        try:
            engine.check_request(prompt, params)
        except ValueError as exc:
            too_long = len(prompt.token_ids) + params.max_tokens > engine.max_model_len
            raise bad_request(str(exc), "messages" if too_long else "max_tokens",
                              Code.CONTEXT_LENGTH_EXCEEDED if too_long else Code.INVALID_VALUE) from None
        return prompt, params

    @functools.cached_property
    def base_sampling(self) -> VideoSampling | None:
        """The sampling every video starts from (None: the model takes no video)."""
        config = self.prompts.video
        return None if config is None else videos.server_sampling(config.sampling, self.video)

    def _videos(self, request: ChatCompletionRequest) -> list[PlannedVideo]:
        """Every video part, counted and of the kind this server takes, then read as far as its plan: the
        header and packets of a ``video_url`` (no frame decoded), or a ``video_ref``'s own. 400
        ``too_many_videos``, ``video_not_supported``, ``video_url_not_supported`` / ``video_ref_not_supported``,
        and the refusals of ``stages.api.videos``."""
        parts = video_parts(request)
        if not parts:
            return []
        if self.base_sampling is None:
            raise bad_request(f"This model ({self.prompts.adapter.family}) does not take video input.", parts[0][1],
                              Code.VIDEO_NOT_SUPPORTED)
        if len(parts) > self.video.max_videos:
            raise bad_request(f"The request has {len(parts)} videos; this server accepts at most "
                              f"{self.video.max_videos} per request.", "messages", Code.TOO_MANY_VIDEOS)
        wanted = "video_ref" if self.mode is ImageMode.REFS else "video_url"
        wrong = next((param for part, param in parts if part.type != wanted), None)
        if wrong is not None:
            refs = self.mode is ImageMode.REFS
            raise bad_request("This server runs in EPD mode (--redis-url): it takes videos only as video_ref parts "
                              "of videos sent to an encoder." if refs else "video_ref parts are taken only by "
                              "prefill and decode servers started with --redis-url (EPD mode); send the video "
                              "itself as a video_url data: URL.", wrong,
                              "video_url_not_supported" if refs else "video_ref_not_supported")
        if self.mode is ImageMode.REFS:
            return [self._referenced(part.video_ref, param) for part, param in parts]
        sampling = videos.request_sampling(self.base_sampling, request.mm_processor_kwargs)
        found = []
        for part, param in parts:
            data = videos.decode_data_url(part.url, self.video, param)
            plan = videos.planned(videos.probe(data, self.video, param), sampling, param)
            found.append(PlannedVideo(plan, video_key(data, sampling.to_json(), LOCAL_FINGERPRINT), data, param))
        self._check_fits(found)
        return found

    def _check_fits(self, found: list[PlannedVideo]) -> None:
        """400 ``context_length_exceeded`` when the videos' placeholders alone fill the context, before any
        frame is decoded (the whole prompt is checked once it is built)."""
        tokens, most = sum(video.plan.num_tokens for video in found), self.engine.max_model_len
        if tokens >= most:
            raise bad_request(f"This model's maximum context length is {most} tokens. However, the request's "
                              f"videos alone fill {tokens} tokens as sampled. Please sample fewer frames or pixels "
                              "(mm_processor_kwargs) or send a shorter video.", "messages",
                              Code.CONTEXT_LENGTH_EXCEEDED)

    def _decode(self, video: PlannedVideo) -> VideoFrames:
        """The plan's frames of one video, decoded here (counted in the stage's video metrics)."""
        start = time.perf_counter()
        frames = videos.frames(video.data, video.plan, self.video, video.param)
        if self.observe_decode is not None:
            self.observe_decode(len(frames), time.perf_counter() - start, len(video.data))
        return VideoFrames(frames, video.plan)

    def _referenced(self, ref: VideoRef, param: str) -> PlannedVideo:
        """A video_ref's plan, its sampling one this server could have made (``contract.video.check_resolved``:
        its model's, within its bounds); 400 ``invalid_video`` otherwise."""
        assert self.base_sampling is not None  # _videos refused the video of a model without video
        try:
            check_resolved(self.base_sampling, VideoSampling.from_json(ref.sampling))
            plan = ref.plan()
        except ValueError as exc:
            raise bad_request(f"The video reference does not make a plan here: {exc}", param,
                              Code.INVALID_VIDEO) from None
        return PlannedVideo(plan, ref.key, b"", param)

    def _fill_pixels(self, prompt: Prompt, sources: list[ReadImage | PlannedVideo]) -> None:
        """Give a prompt built from sizes its pixels (``Prompt.images``), item by item: each video's
        planned frames decoded and preprocessed; each image decoded and preprocessed unless its
        placeholders lie wholly in the prefix the engine's cache holds now (``prefix_hint``, a hint):
        that one stays ``ImageInput.deferred`` (counted in ``observe_skipped``). 400 as ``make_image``
        and the prompt builder refuse an image or video (a file broken past its header: ``invalid_image``)."""
        prompt.images = [self._processed(functools.partial(self._video_input, source))
                         if isinstance(source, PlannedVideo) else self._deferred(source, count)
                         for source, count in zip(sources, prompt.image_tokens)]
        covered = self._covered(prompt)
        prompt.images = [image if i in covered else self._processed(image.loaded)
                         for i, image in enumerate(prompt.images)]
        skipped = sum(image.is_deferred for image in prompt.images)
        if skipped and self.observe_skipped is not None:
            self.observe_skipped(skipped)

    def _covered(self, prompt: Prompt) -> frozenset[int]:
        """The prompt's items whose placeholders the engine's cached prefix holds now (a hint)."""
        hint = self.engine.prefix_hint(prompt)
        return covered_items(prompt.token_ids, self.prompts.adapter.media_token_ids, prompt.image_tokens,
                             hint) if hint else frozenset()

    def _deferred(self, image: ReadImage, num_tokens: int) -> ImageInput:
        """A read image as ``ImageInput.deferred``: its count and grid from its size, made by ``make_image``."""
        return ImageInput.deferred(num_tokens, self.prompts.image_grid(*image.size),
                                   functools.partial(make_image, self.prompts, self.limits, image))

    def _video_input(self, video: PlannedVideo) -> ImageInput:
        """A video's planned frames decoded (``_decode``) and preprocessed."""
        return self.prompts.preprocess_item(self._decode(video))

    @staticmethod
    def _processed(make: Callable[[], ImageInput]) -> ImageInput:
        """``make()``: an item's pixels; what the processor refuses (ValueError) as 400 ``invalid_prompt``,
        as ``_build`` answers it; an APIError (a file that does not decode) passes."""
        try:
            return make()
        except APIError:
            raise
        except ValueError as exc:
            raise bad_request(f"The messages could not be turned into a prompt: {exc}", "messages",
                              "invalid_prompt") from None

    def _build(self, request: ChatCompletionRequest, messages: list[dict], sizes: list) -> Prompt:
        """The prompt from its items' sizes and plans, with the offered tools
        (``ChatCompletionRequest.offered_tools``) rendered by the chat template. 400
        ``tools_not_supported`` if the template has no tool format."""
        offered = request.offered_tools
        extra = {} if offered is None else {"tools": template_tools(offered)}
        try:
            return self.prompts.build_from_sizes(messages, sizes, **extra)
        except ToolsNotSupported:
            raise bad_request("This model's chat template has no tool format, so it cannot be given tools "
                              "(tool_choice none gives it none).", "tools", "tools_not_supported") from None
        except (ValueError, TemplateError) as exc:  # PromptError, an image the processor refuses, a template error
            raise bad_request(f"The messages could not be turned into a prompt: {exc}", "messages",
                              "invalid_prompt") from None

    def _check_sizes(self, request: ChatCompletionRequest, sizes: list[tuple[int, int]]) -> None:
        """400 ``invalid_image`` naming the first image whose size the model's image processor refuses
        (an aspect ratio over 200 for Qwen-VL), before any is preprocessed."""
        for (width, height), (part, param) in zip(sizes, [p for p in image_parts(request) if not p[0].is_video]):
            try:
                self.prompts.num_image_tokens(width, height)
            except ValueError as exc:
                raise bad_request(f"The image's size ({width}x{height}) is refused by this model's image "
                                  f"processor: {exc}", f"{param}.{part.type}", Code.INVALID_IMAGE) from None
