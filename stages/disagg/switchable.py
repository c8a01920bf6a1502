"""``stage serve pd``: a switchable worker. It loads the model once (both halves, PD mode: as a
prefill it encodes images itself) and serves as a prefill or a decode, whichever the router says.

    POST /role {"role": "prefill" | "decode"}    token-protected (``stages.disagg.admin``); 200
                                                 {"role", "previous"}, or 409 while it is busy
    GET  /server_info                            the role's info (``server.stage_info``) plus
                                                 "switchable": true; "role": null until assigned

It starts with no role: chat requests get 503 ``no_role`` until the router assigns one (when the
worker is added, or at the router's startup). A switch is refused while the worker has anything in
flight: requests being generated, requests in its engine, or KV blocks in use (a decode's aborted
room holds its blocks until the prefill confirms). The router drains the worker before switching
(``router.fleet.membership``), so no request is lost. Switching stops the old role's coordinator (and its
supervised tasks: a prefill's bootstrap endpoint closes) and starts the new one; the engine, its
KV pool, the transfer backend's registration, the allow-list of prefills to dial (which the router
may extend at ``/admin/allowed_bootstrap``) and the room timeline stay.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncGenerator
from contextlib import aclosing, asynccontextmanager

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

log = logging.getLogger(__name__)
ROLES = ("prefill", "decode")


class RoleSlot:
    """The worker's current role and its coordinator; changed only by ``switch``, on the event loop."""

    def __init__(self, config: ServerConfig, runtime: StageRuntime, supervisor: Supervisor, seams: Seams) -> None:
        assert config.disagg is not None
        self.config, self.runtime, self.supervisor, self.seams = config, runtime, supervisor, seams
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
        if self._in_flight or stats.waiting or stats.running or stats.blocks_used:
            return (f"{self._in_flight} request(s) in flight, {stats.waiting + stats.running} in the engine, "
                    f"{stats.blocks_used} KV blocks in use")
        return None

    async def switch(self, role: str) -> str | None:
        """Serve ``role`` from now on; the previous role. APIError 409 while busy."""
        async with self._lock:
            previous = self.role
            if role == previous:
                return previous
            if (why := self.busy()) is not None:
                raise APIError(409, f"busy: {why}; drain it before switching roles", code="worker_busy")
            await self._stop_role()
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
            self.coordinator, self._role_supervisor, self.role = coordinator, supervisor, role
            log.info("switchable worker: now a %s (was %s)", role, previous)
            return previous

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

    async def generate(self, request_id: str, prompt: Prompt, params: SamplingParams,
                       body: AnyRequest) -> AsyncGenerator[RequestOutput, None]:
        coordinator = self.coordinator
        if coordinator is None:
            raise APIError(503, "this switchable worker has no role now (the router assigns one: POST /role)",
                           code="no_role", headers={"Retry-After": "1"})
        generate = (prefill_generate(coordinator, None) if isinstance(coordinator, PrefillCoordinator)
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


class RolePreparer:
    """Prompts as the current role takes images: pixels as a prefill (it encodes them), sizes only as
    a decode (``stages.api.chat.Preparer``)."""

    def __init__(self, slot: RoleSlot, pixels: Preparer, sizes: Preparer) -> None:
        self.slot, self.pixels, self.sizes = slot, pixels, sizes

    def __call__(self, body: ChatCompletionRequest) -> tuple[Prompt, SamplingParams]:
        return (self.pixels if self.slot.role == "prefill" else self.sizes)(body)


def build(config: ServerConfig) -> FastAPI:
    """Load the model (both halves) and register the KV pool once; the app starts with no role."""
    from stages.api.routes import create_app
    from stages.api.app_config import AppParts, app_config
    from stages.metrics import Metrics

    disagg = config.disagg
    assert disagg is not None
    metrics, supervisor, seams = Metrics(), Supervisor(), seams_for(config.debug_faults)
    runtime = start_runtime(config.engine, disagg.transfer, disagg.transfer_config, pixels=True, seams=seams,
                            on_step=metrics.observe_step)
    metrics.watch_transfer(disagg.transfer, lambda: runtime.backend.stats)
    slot = RoleSlot(config, runtime, supervisor, seams)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        runtime.engine.start()
        try:
            yield
        finally:
            await supervisor.stop()
            await slot.close()
            runtime.close()

    prepare = RolePreparer(slot, *(Preparer(runtime.prompts, runtime.engine, config.limits, mode, config.video,
                                            metrics.observe_video_decode) for mode in (ImageMode.PIXELS, ImageMode.SIZES)))
    parts = AppParts(runtime.engine, prepare, generate=seams.generate(slot.generate), metrics=metrics,
                     supervisor=supervisor, lifespan=lifespan, tokenizer=runtime.prompts.tokenizer)
    app = create_app(parts, app_config(config, runtime.prompts, lambda: slot.role))
    seams.install(app)

    @app.get(SERVER_INFO_PATH)
    async def server_info() -> dict:
        coordinator = slot.coordinator
        if coordinator is None:
            stats = runtime.engine.stats()
            return {"role": None, "switchable": True, "roles": list(ROLES), "model": config.model_name,
                    "transfer_backend": disagg.transfer, "group": disagg.group,
                    "fingerprint": dataclasses.asdict(runtime.fingerprint),
                    **generation_info(config.engine.generation_config, runtime.prompts.defaults),
                    "kv_blocks": {"used": stats.blocks_used, "total": stats.blocks_total, "cached": stats.blocks_cached},
                    "engine": engine_info(runtime.engine), "instance_id": instance_id()}
        mode = ImageMode.PIXELS if isinstance(coordinator, PrefillCoordinator) else ImageMode.SIZES
        return {**stage_info(config, runtime, coordinator, mode), "switchable": True, "roles": list(ROLES)}

    @app.post("/role", include_in_schema=False)
    async def set_role(request: Request) -> dict:
        check_admin(disagg.admin_token, request)
        role = (await read_json(request)).get("role")
        if role not in ROLES:
            raise APIError(400, f"role must be one of {list(ROLES)}, got {role!r}", param="role",
                           code=Code.INVALID_VALUE)
        return {"role": role, "previous": await slot.switch(role)}

    add_room_route(app, slot.timeline, "pd")
    add_bootstrap_route(app, disagg.admin_token, lambda: slot.allow)
    return app
