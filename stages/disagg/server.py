"""``stage serve prefill`` and ``stage serve decode``: the OpenAI chat route over a room coordinator.

Both servers take the usual chat body plus ``bootstrap_host``, ``bootstrap_port`` and
``bootstrap_room`` (what SGLang's PD router injects), so a client or an existing PD router drives
them directly, sending the same body to both in either order or at once. The decode answers the
client (stream or not). The prefill answers once its part is done: a ``chat.completion`` whose
content is the first token (a choice per sequence for ``n``, with its logprobs when asked) and whose
``finish_reason`` is ``length``. Both add ``GET /server_info``.

Images (``stages.loading``, ``stages.api.chat.ImageMode``): in PD mode the prefill takes pixels and
encodes them, the decode reads only each image's size from its header. In EPD mode (``--redis-url``)
both take ``image_ref`` parts and load only the language model; the prefill reads the embeddings
from the cache (``stages.disagg.embeddings``) while its room pairs, the decode needs only the sizes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncGenerator, Coroutine
from contextlib import aclosing, asynccontextmanager
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI

from contract.bootstrap import BOOTSTRAP_FIELDS
from contract.paths import SERVER_INFO_PATH
from stages.api.chat import ImageMode, Preparer, image_refs
from stages.api.videos import published
from stages.disagg.admin import add_bootstrap_route
from stages.api.errors import APIError, ErrorFields, bad_request
from stages.api.completion_schema import AnyRequest
from stages.api.schemas import ChatCompletionRequest
from stages.config import ServerConfig
from stages.disagg.decode_side import DecodeCoordinator
from stages.disagg.embeddings import EmbeddingShape, ImageInputs, Refs
from stages.disagg.input_feed import InputFeed
from stages.disagg.errors import DisaggError
from stages.disagg.prefill_side import PrefillCoordinator
from stages.disagg.ready import check_size
from stages.disagg.runtime import StageRuntime, start_runtime
from stages.engine.outputs import RequestOutput
from stages.generation_defaults import generation_info
from stages.engine.multimodal import Prompt
from stages.engine.request import FinishReason
from stages.engine.sampling_params import SamplingParams
from stages import tracing
from stages.faults.seams import seams_for
from stages.supervisor import Supervisor
from stages.timeline import FAILED, RoomTimeline, add_room_route

if TYPE_CHECKING:  # imported where used (cache: an EPD prefill only)
    from cache.store import EmbeddingCache
    from stages.metrics import Metrics


def _room(body: AnyRequest) -> tuple[int, str, int]:
    """The request's room and its prefill's bootstrap address; 400 naming the first field missing."""
    host, port, room = body.bootstrap_host, body.bootstrap_port, body.bootstrap_room
    if host is None or port is None or room is None:
        name = next(name for name, value in zip(BOOTSTRAP_FIELDS, (host, port, room)) if value is None)
        raise bad_request(f"Missing required parameter: '{name}' (a prefill or decode server needs "
                          "bootstrap_host, bootstrap_port and bootstrap_room).", name, "missing_required_parameter")
    return room, host, port


def _api_error(exc: DisaggError, stage: str, room: int) -> APIError:
    """The answer of ``stage`` (prefill or decode) for ``room``'s failure, its typed fields set."""
    retry = {"Retry-After": str(exc.retry_after_s)} if exc.retry_after_s is not None else None
    fields = ErrorFields(stage=stage, room=room, image_key=exc.image_key, peer_code=exc.peer_code)
    return APIError(exc.status, str(exc), param=exc.param, code=exc.code, headers=retry, fields=fields)


async def _as_api_errors(outputs: AsyncGenerator[RequestOutput, None], stage: str,
                         room: int) -> AsyncGenerator[RequestOutput, None]:
    """``outputs``, its DisaggError raised as the APIError the server answers (in-band once streaming)."""
    try:
        async for output in outputs:
            yield output
    except DisaggError as exc:
        raise _api_error(exc, stage, room) from exc
    finally:
        await outputs.aclose()


def prefill_generate(coordinator: PrefillCoordinator, inputs: ImageInputs | None):
    """``inputs``: EPD mode, where the prompt's embeddings come from the cache by reference. Before the
    response starts: 400 without the bootstrap fields, 409 for a room this prefill holds or closed."""

    async def generate(request_id: str, prompt: Prompt, params: SamplingParams,
                       body: AnyRequest) -> AsyncGenerator[RequestOutput, None]:
        room, _, _ = _room(body)
        try:
            coordinator.check(room)
            check_size(len(prompt.token_ids), params)
        except DisaggError as exc:
            raise _api_error(exc, "prefill", room) from exc

        trace = tracing.current()  # None: tracing off

        async def prefilled() -> AsyncGenerator[RequestOutput, None]:
            fill, feed = None, None
            # only a chat body has images (a completions prompt is text)
            if inputs is not None and prompt.num_images and isinstance(body, ChatCompletionRequest):
                fill, feed = _room_inputs(coordinator, inputs, prompt, image_refs(body))
            try:
                result = await coordinator.prefill(room, prompt, params, fill, feed)
            finally:
                if trace is not None:  # the room's spans, under the decode's trace if the client sent none here
                    decodes = coordinator.traceparent_of(room)
                    trace.record("prefill", coordinator.timeline.events(room), room,
                                 None if trace.incoming else decodes)
            for output in result.outputs:  # one per sequence: its first token (and logprobs), as a length stop
                yield dataclasses.replace(output, request_id=request_id, finish_reason=FinishReason.LENGTH,
                                          completion_tokens=1)

        return _as_api_errors(prefilled(), "prefill", room)

    return generate


def _room_inputs(coordinator: PrefillCoordinator, inputs: ImageInputs, prompt: Prompt,
                 refs: Refs) -> tuple[Coroutine[Any, Any, None], InputFeed | None]:
    """An EPD room's reader of its embeddings and, with ``--prefill-overlap``, the feed it fills: the
    prompt's embeddings become pending stand-ins, and the images its cached prefix covers now are left
    for the room's runner to read only if the admitted request needs them (``stages.disagg.input_feed``)."""
    if not coordinator.config.prefill_overlap:
        return inputs.fill(prompt, refs), None
    prompt.embeddings = inputs.stand_ins(refs)
    covered = inputs.covered(prompt, coordinator.engine.prefix_hint(prompt))
    feed = InputFeed(covered, lambda only: inputs.fill(prompt, refs, feed.arrived, only), inputs.skipped)
    return inputs.fill(prompt, refs, feed.arrived, [i for i in range(len(refs)) if i not in covered]), feed


def decode_generate(coordinator: DecodeCoordinator):
    """Before the response starts: 400 without the bootstrap fields, 403 for a prefill the decode may
    not dial, 409 for a room in flight here."""

    async def generate(request_id: str, prompt: Prompt, params: SamplingParams,
                       body: AnyRequest) -> AsyncGenerator[RequestOutput, None]:
        room, host, port = _room(body)
        try:
            coordinator.check(room, host, port)
            check_size(len(prompt.token_ids), params)
        except DisaggError as exc:
            raise _api_error(exc, "decode", room) from exc
        trace = tracing.current()  # None: tracing off
        outputs = _as_api_errors(coordinator.generate(room, host, port, prompt, params,
                                                      None if trace is None else trace.traceparent), "decode", room)
        return outputs if trace is None else _recorded(outputs, coordinator, trace, room)

    return generate


async def _recorded(outputs: AsyncGenerator[RequestOutput, None], coordinator: DecodeCoordinator,
                    trace: tracing.StageTrace, room: int) -> AsyncGenerator[RequestOutput, None]:
    """``outputs``, the decode's room recorded as spans (``stages.tracing``) once they end or fail. A
    room that failed before the prefill answered is failed by its cleanup task (the abort it sends),
    scheduled already: the record waits one turn of the loop for its ``failed`` event, and stands one
    in with the error's reason if it still is not there."""
    try:
        async with aclosing(outputs):
            async for output in outputs:
                yield output
    except BaseException as exc:
        asyncio.get_running_loop().call_soon(_record_failed, coordinator, trace, room, str(exc) or type(exc).__name__)
        raise
    else:
        trace.record("decode", coordinator.timeline.events(room), room)


def _record_failed(coordinator: DecodeCoordinator, trace: tracing.StageTrace, room: int, reason: str) -> None:
    events = coordinator.timeline.events(room) or []
    if not any(e["event"] in ("finished", FAILED) for e in events):
        events = [*events, {"event": FAILED, "t": time.time(), "reason": reason}]
    trace.record("decode", events, room)


def build(config: ServerConfig) -> FastAPI:
    """Load the model, register the KV pool, build the role's coordinator and the app. The app's
    lifespan starts the coordinator and the engine thread, and stops them in reverse order."""
    from stages.api.routes import create_app
    from stages.api.app_config import AppParts, app_config
    from stages.metrics import Metrics

    disagg = config.disagg
    assert disagg is not None  # ServerConfig guarantees it for these roles
    metrics, supervisor, seams = Metrics(), Supervisor(), seams_for(config.debug_faults)
    mode = ImageMode.REFS if disagg.epd else ImageMode.PIXELS if config.role == "prefill" else ImageMode.SIZES
    runtime = start_runtime(config.engine, disagg.transfer, disagg.transfer_config, pixels=mode is ImageMode.PIXELS,
                            seams=seams, on_step=metrics.observe_step)
    metrics.watch_transfer(disagg.transfer, lambda: runtime.backend.stats)
    cache = _open_cache(config, metrics) if config.role == "prefill" and disagg.epd else None
    timeline, allow = RoomTimeline(), disagg.allow_list()
    coordinator: PrefillCoordinator | DecodeCoordinator
    if config.role == "prefill":
        coordinator = PrefillCoordinator(runtime, disagg, supervisor=supervisor, hooks=seams.prefill(),
                                         timeline=timeline)
        adapter = runtime.prompts.adapter
        inputs = None if cache is None else ImageInputs(
            cache, EmbeddingShape(adapter.text_config.hidden_size, adapter.deepstack_layers), runtime.prompts,
            disagg.embedding_timeout_s, metrics.prefill_images_skipped.inc)
        generate = seams.generate(prefill_generate(coordinator, inputs))
    else:
        coordinator = DecodeCoordinator(runtime, disagg, supervisor=supervisor, hooks=seams.decode(),
                                        timeline=timeline, allow=allow)
        generate = seams.generate(decode_generate(coordinator))

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await coordinator.start()
        runtime.engine.start()
        try:
            yield
        finally:
            await supervisor.stop()
            await coordinator.close()
            if cache is not None:
                await cache.aclose()
            runtime.close()

    prepare = Preparer(runtime.prompts, runtime.engine, config.limits, mode, config.video,
                       metrics.observe_video_decode, metrics.images_preprocess_skipped.inc)
    parts = AppParts(runtime.engine, prepare, generate=generate, metrics=metrics, supervisor=supervisor,
                     lifespan=lifespan, tokenizer=runtime.prompts.tokenizer)
    app = create_app(parts, app_config(config, runtime.prompts, config.role))
    seams.install(app)

    @app.get(SERVER_INFO_PATH)
    async def server_info() -> dict:
        return stage_info(config, runtime, coordinator, mode)

    add_room_route(app, timeline, config.role)
    if config.role == "decode":
        add_bootstrap_route(app, disagg.admin_token, lambda: allow)
    return app


def stage_info(config: ServerConfig, runtime: StageRuntime, coordinator: PrefillCoordinator | DecodeCoordinator,
               mode: ImageMode) -> dict:
    """``GET /server_info`` of a prefill or decode (or a switchable worker in one of those roles)."""
    from stages.resources import engine_info, limits_info, model_info

    disagg = config.disagg
    assert disagg is not None
    stats = runtime.engine.stats()
    info = {
        "role": "prefill" if isinstance(coordinator, PrefillCoordinator) else "decode",
        "model": config.model_name,
        "model_path": config.engine.model,
        "transfer_backend": disagg.transfer,
        "fingerprint": dataclasses.asdict(runtime.fingerprint),
        **generation_info(config.engine.generation_config, runtime.prompts.defaults),
        "kv_blocks": {"used": stats.blocks_used, "total": stats.blocks_total, "cached": stats.blocks_cached},
        "engine": engine_info(runtime.engine),
        "transfer": dataclasses.asdict(runtime.backend.stats),
        "group": disagg.group,
        **model_info(runtime.prompts.adapter, mode.value),
        "limits": limits_info(config, runtime.engine.max_model_len, runtime.prompts.chars_per_token),
        "video": published(runtime.prompts.video, config.video),
    }
    if disagg.cache is not None:
        info["redis_url"] = disagg.cache.safe_url
    if isinstance(coordinator, PrefillCoordinator):
        info["bootstrap"] = {"host": disagg.bootstrap_host, "port": coordinator.bootstrap_port}
    else:
        client = coordinator.client
        info["peer_links"] = {"open": list(client.links.addresses()), "max": disagg.max_peer_links,
                              "allowed": list(client.allow.patterns())}
    return info


def _open_cache(config: ServerConfig, metrics: Metrics) -> EmbeddingCache:
    """An EPD prefill's embedding cache (connects on first use), its ``epd_cache_*`` series on ``metrics``."""
    from cache.metrics import register_cache_metrics
    from cache.store import EmbeddingCache

    assert config.disagg is not None and config.disagg.cache is not None
    cache = EmbeddingCache(config.disagg.cache)
    register_cache_metrics(metrics.registry, cache.stats)
    return cache
