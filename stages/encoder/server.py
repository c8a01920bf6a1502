"""``stage serve encoder``: the encoder server. Its encode and abort routes are
``stages.encoder.routes`` (wire format in ``docs/protocol.md``); its parts ``stages.encoder.stack``.

    POST /v1/encode  POST /v1/abort  GET /rooms/{room}   (``stages.encoder.routes``)
    GET  /health  /server_info  /metrics  (and /debug/faults with --debug-faults)

``/health`` is 503 only when the encoder thread or the claim-renewal loop died.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from contract.paths import HEALTH_PATH, SERVER_INFO_PATH
from stages.api.body import ReleaseMemory
from stages.api.errors import install_error_handlers, unhealthy
from stages.api.openapi import HEALTH_ROUTE, METRICS_ROUTE, install
from stages.config import ServerConfig
from stages.encoder.openapi import SERVER_INFO_ROUTE
from stages.encoder.routes import AbortRequest, EncodeRequest, add_encode_routes
from stages.encoder.stack import EncoderStack, build_stack
from stages.supervisor import Supervisor
from stages.timeline import RoomTimeline, add_room_route


def build(config: ServerConfig) -> FastAPI:
    """Load the vision half of the model and build the app; its lifespan starts and stops the
    encoder thread and the claim-renewal loop and closes the cache."""
    import torch

    from cache.store import EmbeddingCache
    from stages.engine.config import VISION
    from stages.engine.models import load_adapter
    from stages.faults.seams import seams_for

    assert config.encoder is not None
    device = config.engine.torch_device  # the vision tower runs there; embeddings go to the cache as bytes
    if device.type == "cpu":
        torch.set_num_threads(config.engine.threads)
    torch.manual_seed(config.engine.seed)
    dtype = config.engine.dtype_choice  # --dtype, or what auto chose for this checkpoint on this device
    adapter = load_adapter(config.engine.model, getattr(torch, dtype.name), "sdpa", parts=(VISION,), device=device)
    cache = EmbeddingCache(config.encoder.cache)
    seams, supervisor = seams_for(config.debug_faults), Supervisor()
    stack = build_stack(config, adapter, cache, seams)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        stack.start(supervisor)
        try:
            yield
        finally:
            await stack.stop()
            await supervisor.stop()
            await cache.aclose()

    app = create_encoder_app(stack, config, supervisor, stack.metrics.render, lifespan)
    seams.install(app)
    return app


def create_encoder_app(stack: EncoderStack, config: ServerConfig, supervisor: Supervisor,
                       render_metrics: Callable[[], bytes], lifespan: Any) -> FastAPI:
    from process.instance import instance_id
    from stages.resources import rss_bytes

    timeline = RoomTimeline()
    app = FastAPI(title="epd-stage encoder", version="0.1.0", lifespan=lifespan)
    install_error_handlers(app, "encoder")
    app.add_middleware(ReleaseMemory)
    install(app, (EncodeRequest, AbortRequest))

    @app.get(HEALTH_PATH, **HEALTH_ROUTE)
    async def health() -> dict:
        failures = supervisor.failures()
        if failures:
            raise unhealthy(failures)
        return {"status": "ok"}

    @app.get(SERVER_INFO_PATH, **SERVER_INFO_ROUTE)
    async def server_info() -> dict:
        return {**stack.info, "rss_bytes": rss_bytes(), "instance_id": instance_id()}

    @app.get("/metrics", **METRICS_ROUTE)
    async def prometheus() -> Response:
        return Response(render_metrics(), media_type=CONTENT_TYPE_LATEST)

    add_encode_routes(app, stack.service, config, timeline, stack.fingerprint)
    add_room_route(app, timeline, "encoder")
    return app
