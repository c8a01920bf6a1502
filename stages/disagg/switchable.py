"""``stage serve pd``: a switchable worker. It loads the model once (both halves) and serves as a
prefill or a decode, whichever the router says; with ``--redis-url`` (EPD mode) as an encoder too.

    POST /role {"role": "encoder" | "prefill" | "decode"}   token-protected (``stages.disagg.admin``);
                                                 200 {"role", "previous"}, or 409 while it is busy
    GET  /server_info                            the role's info (``server.stage_info``, or the
                                                 encoder's) plus "switchable": true and "roles" (the
                                                 roles it can take); "role": null until assigned
    POST /v1/encode, /v1/abort                   EPD mode: as an encoder's (``stages.encoder.routes``),
                                                 served as an encoder and as a prefill (local encoding:
                                                 the router sends a prefill its own request's images)

PD mode: as a prefill it takes pixels and encodes them itself; EPD mode: as a prefill it takes image
references and reads their embeddings from the cache, as a decode only their sizes, as an encoder it
encodes images into the cache. The encoder's parts (``stages.encoder.stack``) live as long as the
worker: the vision tower is the model's own, the fingerprint an encoder of the same checkpoint has.

It starts with no role: chat requests get 503 ``no_role`` until the router assigns one (when the
worker is added, or at the router's startup); as an encoder, 503 ``no_role`` too, and a decode (or a
worker with no role) answers encode calls 503 ``no_role``. A switch is refused while the worker has
anything in flight: requests being generated, requests in its engine, KV blocks in use (a decode's
aborted room holds its blocks until the prefill confirms), encode requests or images being encoded
(each image's flight ends, its entry written and its claim released, before the worker may switch).
The router drains the worker before switching (``router.fleet.membership``), so no request is lost.
Switching stops the old role's coordinator (and its supervised tasks: a prefill's bootstrap endpoint
closes) and starts the new one; the engine, its KV pool, the transfer backend's registration, the
encoder's parts, the allow-list of prefills to dial (which the router may extend at
``/admin/allowed_bootstrap``) and the room timeline stay.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncGenerator
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request

from contract.errors import Code
from contract.paths import SERVER_INFO_PATH
from stages.api.chat import ImageMode, Preparer
from stages.api.errors import APIError
from stages.api.completion_schema import AnyRequest
from stages.api.schemas import ChatCompletionRequest
from stages.config import ServerConfig
from stages.disagg.admin import add_bootstrap_route, check_admin, read_json
from stages.disagg.decode_side import DecodeCoordinator
from stages.disagg.embeddings import ImageInputs
from stages.disagg.prefill_side import PrefillCoordinator
from stages.disagg.runtime import StageRuntime, start_runtime
from stages.disagg.server import decode_generate, prefill_generate, stage_info
from stages.engine.outputs import RequestOutput
from stages.engine.multimodal import Prompt
from stages.engine.sampling_params import SamplingParams
from stages.faults.seams import Seams, seams_for
from stages.generation_defaults import generation_info
from stages.resources import engine_info
from process.instance import instance_id
from stages.supervisor import Supervisor
from stages.timeline import RoomTimeline, add_room_route

if TYPE_CHECKING:  # EPD mode only
    from cache.store import EmbeddingCache
    from stages.encoder.stack import EncoderStack
    from stages.metrics import Metrics

log = logging.getLogger(__name__)
PD_ROLES = ("prefill", "decode")
EPD_ROLES = ("encoder", "prefill", "decode")


@dataclass(frozen=True)
class EPDParts:
    """What EPD mode adds: the cache, the encoder's parts, and the prefill's way to the embeddings."""

    cache: EmbeddingCache
    encoder: EncoderStack
    inputs: ImageInputs
    timeline: RoomTimeline = dataclasses.field(default_factory=RoomTimeline)  # the encode calls' events


class RoleSlot:
    """The worker's current role and its coordinator; changed only by ``switch``, on the event loop.
    ``epd``: EPD mode's parts (None in PD mode)."""

    def __init__(self, config: ServerConfig, runtime: StageRuntime, supervisor: Supervisor, seams: Seams,
                 epd: EPDParts | None = None) -> None:
        assert config.disagg is not None
        self.config, self.runtime, self.supervisor, self.seams, self.epd = config, runtime, supervisor, seams, epd
        self.roles = PD_ROLES if epd is None else EPD_ROLES
        self.timeline = RoomTimeline()
        self.allow = config.disagg.allow_list()
        self.role: str | None = None
        self.coordinator: PrefillCoordinator | DecodeCoordinator | None = None
        self._role_supervisor: Supervisor | None = None
        self._in_flight = 0  # requests inside generate
        self._lock = asyncio.Lock()

    def busy(self) -> str | None:
        """What the worker still has in flight, or None if it may switch."""
        stats = self.runtime.engine.stats()
        encoding = None if self.epd is None else self.epd.encoder.service.busy()
        if self._in_flight or stats.waiting or stats.running or stats.blocks_used or encoding:
            return "; ".join(filter(None, (
                f"{self._in_flight} request(s) in flight, {stats.waiting + stats.running} in the engine, "
                f"{stats.blocks_used} KV blocks in use", encoding)))
        return None

    async def switch(self, role: str) -> str | None:
        """Serve ``role`` (one of ``roles``) from now on; the previous role. APIError 409 while busy."""
        async with self._lock:
            previous = self.role
            if role == previous:
                return previous
            if (why := self.busy()) is not None:
                raise APIError(409, f"busy: {why}; drain it before switching roles", code="worker_busy")
            await self._stop_role()
            if role != "encoder":
                await self._start_coordinator(role)
            self.role = role
            log.info("switchable worker: now a %s (was %s)", role, previous)
            return previous

    async def _start_coordinator(self, role: str) -> None:
        supervisor = Supervisor()
        disagg, runtime = self.config.disagg, self.runtime
        assert disagg is not None
        coordinator: PrefillCoordinator | DecodeCoordinator
        if role == "prefill":
            coordinator = PrefillCoordinator(runtime, disagg, supervisor=supervisor, hooks=self.seams.prefill(),
                                             timeline=self.timeline)
        else:
            coordinator = DecodeCoordinator(runtime, disagg, supervisor=supervisor, hooks=self.seams.decode(),
                                            timeline=self.timeline, allow=self.allow)
        await coordinator.start()
        self.supervisor.adopt("role", supervisor)
        self.coordinator, self._role_supervisor = coordinator, supervisor

    async def close(self) -> None:
        async with self._lock:
            await self._stop_role()

    async def _stop_role(self) -> None:
        """Take the coordinator out of service at once (new requests get 503), then stop it."""
        coordinator, supervisor = self.coordinator, self._role_supervisor
        self.coordinator, self._role_supervisor, self.role = None, None, None
        if supervisor is not None:
            await supervisor.stop()
        if coordinator is not None:
            await coordinator.close()

    def encode_refusal(self) -> APIError | None:
        """The answer to an encode call in this role: None (served) as an encoder or a prefill."""
        if self.role in ("encoder", "prefill"):
            return None
        return APIError(503, f"this switchable worker serves as {_a(self.role)} now and takes no encode calls",
                        code="no_role", headers={"Retry-After": "1"})

    async def generate(self, request_id: str, prompt: Prompt, params: SamplingParams,
                       body: AnyRequest) -> AsyncGenerator[RequestOutput, None]:
        coordinator = self.coordinator
        if coordinator is None:
            raise APIError(503, f"this switchable worker serves as {_a(self.role)} now, not a prefill or a decode "
                           "(the router assigns its role: POST /role)", code="no_role", headers={"Retry-After": "1"})
        inputs = None if self.epd is None else self.epd.inputs
        generate = (prefill_generate(coordinator, inputs) if isinstance(coordinator, PrefillCoordinator)
                    else decode_generate(coordinator))
        return self._counted(await generate(request_id, prompt, params, body))

    async def _counted(self, outputs: AsyncGenerator[RequestOutput, None]) -> AsyncGenerator[RequestOutput, None]:
        """``outputs``, counted in flight (a role switch waits for none) from the first step to the end."""
        self._in_flight += 1
        try:
            async with aclosing(outputs):
                async for output in outputs:
                    yield output
        finally:
            self._in_flight -= 1


def _a(role: str | None) -> str:
    return "no role" if role is None else f"an {role}" if role == "encoder" else f"a {role}"


class RolePreparer:
    """Prompts as the current role takes images (``stages.api.chat.Preparer``): PD mode, pixels as a
    prefill (it encodes them) and sizes only as a decode; EPD mode, references in every role."""

    def __init__(self, slot: RoleSlot, prefill: Preparer, other: Preparer) -> None:
        self.slot, self.prefill, self.other = slot, prefill, other

    def __call__(self, body: ChatCompletionRequest) -> tuple[Prompt, SamplingParams]:
        return (self.prefill if self.slot.role == "prefill" else self.other)(body)


def image_modes(epd: bool) -> tuple[ImageMode, ImageMode]:
    """How a switchable worker takes images as a prefill and in its other roles."""
    return (ImageMode.REFS, ImageMode.REFS) if epd else (ImageMode.PIXELS, ImageMode.SIZES)


def build(config: ServerConfig) -> FastAPI:
    """Load the model (both halves) and register the KV pool once; EPD mode also builds the encoder's
    parts over the same model. The app starts with no role."""
    from stages.api.routes import create_app
    from stages.api.app_config import AppParts, app_config
    from stages.metrics import Metrics

    disagg = config.disagg
    assert disagg is not None
    metrics, supervisor, seams = Metrics(), Supervisor(), seams_for(config.debug_faults)
    runtime = start_runtime(config.engine, disagg.transfer, disagg.transfer_config, pixels=True, seams=seams,
                            on_step=metrics.observe_step)
    metrics.watch_transfer(disagg.transfer, lambda: runtime.backend.stats)
    epd = _epd_parts(config, runtime, seams, metrics) if config.encodes else None
    slot = RoleSlot(config, runtime, supervisor, seams, epd)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        runtime.engine.start()
        if epd is not None:
            epd.encoder.start(supervisor)
        try:
            yield
        finally:
            await supervisor.stop()
            await slot.close()
            if epd is not None:
                await epd.encoder.stop()
                await epd.cache.aclose()
            runtime.close()

    modes = image_modes(epd is not None)
    prepare = RolePreparer(slot, *(Preparer(runtime.prompts, runtime.engine, config.limits, mode, config.video,
                                            metrics.observe_video_decode, metrics.images_preprocess_skipped.inc)
                                   for mode in modes))
    parts = AppParts(runtime.engine, prepare, generate=seams.generate(slot.generate), metrics=metrics,
                     supervisor=supervisor, lifespan=lifespan, tokenizer=runtime.prompts.tokenizer)
    app = create_app(parts, app_config(config, runtime.prompts, lambda: slot.role))
    seams.install(app)
    _add_role_routes(app, slot)
    if epd is not None:
        from stages.encoder.routes import add_encode_routes
        add_encode_routes(app, epd.encoder.service, config, epd.timeline, epd.encoder.fingerprint,
                          slot.encode_refusal)
    add_room_route(app, slot.timeline, "pd", None if epd is None else epd.timeline)
    add_bootstrap_route(app, disagg.admin_token, lambda: slot.allow)
    return app


def _epd_parts(config: ServerConfig, runtime: StageRuntime, seams: Seams, metrics: Metrics) -> EPDParts:
    """EPD mode's cache (its ``epd_cache_*`` series on ``metrics``' registry), the encoder's parts over
    the runtime's model (theirs there too) and the prefill's embedding reader (counting the images it
    skips on ``metrics``)."""
    registry, skipped = metrics.registry, metrics.prefill_images_skipped.inc
    from cache.metrics import register_cache_metrics
    from cache.store import EmbeddingCache
    from stages.disagg.embeddings import EmbeddingShape
    from stages.encoder.stack import build_stack

    disagg = config.disagg
    assert disagg is not None and disagg.cache is not None
    cache = EmbeddingCache(disagg.cache)
    register_cache_metrics(registry, cache.stats)
    adapter = runtime.prompts.adapter
    encoder = build_stack(config, adapter, cache, seams, registry)
    inputs = ImageInputs(cache, EmbeddingShape(adapter.text_config.hidden_size, adapter.deepstack_layers),
                         runtime.prompts, disagg.embedding_timeout_s, skipped)
    return EPDParts(cache, encoder, inputs)


def _add_role_routes(app: FastAPI, slot: RoleSlot) -> None:
    """``GET /server_info`` (the current role's) and ``POST /role``."""
    config, runtime, disagg, epd = slot.config, slot.runtime, slot.config.disagg, slot.epd
    assert disagg is not None
    prefill_mode, other_mode = image_modes(epd is not None)

    @app.get(SERVER_INFO_PATH)
    async def server_info() -> dict:
        coordinator, switchable = slot.coordinator, {"switchable": True, "roles": list(slot.roles)}
        if slot.role == "encoder" and epd is not None:
            from stages.resources import rss_bytes
            return {**epd.encoder.info, **switchable, "group": disagg.group, "rss_bytes": rss_bytes(),
                    "instance_id": instance_id()}
        if coordinator is None:
            stats = runtime.engine.stats()
            return {"role": None, **switchable, "model": config.model_name,
                    "transfer_backend": disagg.transfer, "group": disagg.group,
                    "fingerprint": dataclasses.asdict(runtime.fingerprint),
                    **generation_info(config.engine.generation_config, runtime.prompts.defaults),
                    "kv_blocks": {"used": stats.blocks_used, "total": stats.blocks_total, "cached": stats.blocks_cached},
                    "engine": engine_info(runtime.engine), "instance_id": instance_id()}
        prefill = isinstance(coordinator, PrefillCoordinator)
        info = {**stage_info(config, runtime, coordinator, prefill_mode if prefill else other_mode), **switchable}
        if prefill and epd is not None:  # it encodes its own requests' images when the router sends them
            info |= {key: epd.encoder.info[key] for key in ("encoder_id", "vision_fingerprint")}
        return info

    @app.post("/role", include_in_schema=False)
    async def set_role(request: Request) -> dict:
        check_admin(disagg.admin_token, request)
        role = (await read_json(request)).get("role")
        if not isinstance(role, str) or role not in slot.roles:
            why = "" if role not in EPD_ROLES else " (an encoder only in EPD mode: start it with --redis-url)"
            raise APIError(400, f"role must be one of {list(slot.roles)}, got {role!r}{why}", param="role",
                           code=Code.INVALID_VALUE)
        return {"role": role, "previous": await slot.switch(role)}
