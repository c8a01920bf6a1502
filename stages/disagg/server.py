"""``stage serve prefill`` and ``stage serve decode``: the OpenAI chat route over a room coordinator.

Both servers take the usual chat body plus ``bootstrap_host``, ``bootstrap_port`` and
``bootstrap_room`` (what SGLang's PD router injects), so a client or an existing PD router drives
them directly, sending the same body to both in either order or at once. The decode answers the
client (stream or not). The prefill answers once its part is done: a ``chat.completion`` whose
content is the first token and whose ``finish_reason`` is ``length``. Both add ``GET /server_info``.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import FastAPI

from stages.api.errors import APIError, bad_request
from stages.api.images import ImageLimits
from stages.api.schemas import ChatCompletionRequest
from stages.disagg.config import DisaggConfig
from stages.disagg.decode_side import DecodeCoordinator
from stages.disagg.errors import DisaggError
from stages.disagg.prefill_side import PrefillCoordinator
from stages.disagg.runtime import StageRuntime, start_runtime
from stages.engine.config import EngineConfig
from stages.engine.engine import RequestOutput
from stages.engine.multimodal import Prompt
from stages.engine.request import FinishReason
from stages.engine.sampling_params import SamplingParams
from transfer.base import TransferConfig

log = logging.getLogger(__name__)
ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class StageServerConfig:
    role: str
    engine: EngineConfig
    transfer: str = "mooncake"
    transfer_config: TransferConfig = field(default_factory=TransferConfig)
    disagg: DisaggConfig = field(default_factory=DisaggConfig)
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    limits: ImageLimits = field(default_factory=ImageLimits)
    log_level: str = "info"

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.engine.model).resolve().name


def _room(body: ChatCompletionRequest) -> tuple[int, str, int]:
    if body.bootstrap_room is None or body.bootstrap_host is None or body.bootstrap_port is None:
        raise bad_request("a prefill or decode server needs bootstrap_host, bootstrap_port and bootstrap_room",
                          param="bootstrap_room")
    return body.bootstrap_room, body.bootstrap_host, body.bootstrap_port


def _api_error(exc: DisaggError) -> APIError:
    return APIError(exc.status, str(exc), code=exc.code, type="server_error" if exc.status >= 500 else None)


def prefill_generate(coordinator: PrefillCoordinator):
    async def generate(request_id: str, prompt: Prompt, params: SamplingParams,
                       body: ChatCompletionRequest) -> AsyncIterator[RequestOutput]:
        room, _, _ = _room(body)
        try:
            result = await coordinator.prefill(room, prompt, params)
        except DisaggError as exc:
            raise _api_error(exc) from exc
        yield RequestOutput(request_id, result.text, [result.first_token], FinishReason.LENGTH,
                            result.prompt_tokens, 1, rope_delta=result.rope_delta)

    return generate


def decode_generate(coordinator: DecodeCoordinator):
    async def generate(request_id: str, prompt: Prompt, params: SamplingParams,
                       body: ChatCompletionRequest) -> AsyncIterator[RequestOutput]:
        room, host, port = _room(body)
        try:
            async for output in coordinator.generate(room, host, port, prompt, params):
                yield output
        except DisaggError as exc:
            raise _api_error(exc) from exc

    return generate


async def start_stage(config: StageServerConfig, runtime: StageRuntime):
    """Start the role's coordinator inside the running event loop; returns (coordinator, generate)."""
    if config.role == "prefill":
        coordinator = PrefillCoordinator(runtime.engine, runtime.backend, runtime.fingerprint, config.disagg)
        await coordinator.start()
        return coordinator, prefill_generate(coordinator)
    coordinator = DecodeCoordinator(runtime.engine, runtime.backend, runtime.fingerprint, config.disagg)
    return coordinator, decode_generate(coordinator)


def build(config: StageServerConfig) -> FastAPI:
    from contextlib import asynccontextmanager

    from stages.api.routes import create_app
    from stages.metrics import Metrics

    metrics = Metrics()
    runtime = start_runtime(config.engine, config.transfer, config.transfer_config, on_step=metrics.observe_step)
    metrics.watch_transfer(config.transfer, lambda: runtime.backend.stats)
    state: dict = {}

    async def generate(*args):
        async for output in state["generate"](*args):
            yield output

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        coordinator, state["generate"] = await start_stage(config, runtime)
        state["coordinator"] = coordinator
        runtime.engine.start()
        try:
            yield
        finally:
            await coordinator.close()
            runtime.close()

    app = create_app(runtime.engine, model_name=config.model_name, limits=config.limits, metrics=metrics,
                     generate=generate, lifespan=lifespan)

    @app.get("/server_info")
    async def server_info() -> dict:
        coordinator = state.get("coordinator")
        stats = runtime.engine.stats()
        info = {
            "role": config.role,
            "model": config.model_name,
            "model_path": config.engine.model,
            "transfer_backend": config.transfer,
            "fingerprint": {k: getattr(runtime.fingerprint, k) for k in runtime.fingerprint.__dataclass_fields__},
            "kv_blocks": {"used": stats.blocks_used, "total": stats.blocks_total},
            "transfer": dataclasses.asdict(runtime.backend.stats),
        }
        if isinstance(coordinator, PrefillCoordinator):
            info["bootstrap"] = {"host": config.disagg.bootstrap_host, "port": coordinator.bootstrap_port}
        return info

    return app


def serve(config: StageServerConfig) -> None:
    import uvicorn

    log.info("loading %s for the %s role (transfer %s)", config.engine.model, config.role, config.transfer)
    app = build(config)
    sock = socket.socket(socket.AF_INET6 if ":" in config.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((config.host, config.port))
    host, port = sock.getsockname()[:2]
    log.info("%s server for %r listening on http://%s:%d", config.role, config.model_name, host, port)
    server = uvicorn.Server(uvicorn.Config(app, log_level=config.log_level, timeout_graceful_shutdown=5,
                                           access_log=False))
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
