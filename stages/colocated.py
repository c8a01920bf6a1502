"""``stage serve colocated``: encode, prefill and decode in one process, one engine, no transfer.

The baseline for every comparison and the reference for parity tests. Startup order: load the
model (the slow part), start the engine thread, then bind the port, so the server answers
``/health`` only once it can serve.
"""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass, field
from pathlib import Path

from stages.api.images import ImageLimits
from stages.engine.config import EngineConfig

log = logging.getLogger("stages.colocated")


@dataclass(frozen=True)
class ServerConfig:
    engine: EngineConfig
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None  # None: the model directory's name
    limits: ImageLimits = field(default_factory=ImageLimits)
    log_level: str = "info"

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise ValueError("--served-model-name must not be empty")

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.engine.model).resolve().name


def build(config: ServerConfig):  # -> tuple[FastAPI, AsyncEngine]
    """Load the model and build the app; the caller starts and stops the returned AsyncEngine."""
    from stages.api.routes import create_app
    from stages.engine.async_engine import AsyncEngine
    from stages.engine.engine import Engine
    from stages.metrics import Metrics

    engine = Engine(config.engine)
    metrics = Metrics()
    async_engine = AsyncEngine(engine, on_step=metrics.observe_step)
    app = create_app(async_engine, model_name=config.model_name, limits=config.limits, metrics=metrics)
    return app, async_engine


def serve(config: ServerConfig) -> None:
    """Run until SIGINT/SIGTERM."""
    import uvicorn

    log.info("loading %s (threads=%d, kv cache %d MiB)", config.engine.model, config.engine.threads,
             config.engine.kv_cache_mib)
    app, engine = build(config)
    sock = socket.socket(socket.AF_INET6 if ":" in config.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((config.host, config.port))
    host, port = sock.getsockname()[:2]
    server = uvicorn.Server(uvicorn.Config(app, log_level=config.log_level, timeout_graceful_shutdown=5,
                                           access_log=False))
    engine.start()
    log.info("colocated server for model %r (max_model_len %d, %d KV blocks) listening on http://%s:%d",
             config.model_name, engine.engine.max_model_len, engine.engine.allocator.num_blocks, host, port)
    try:
        server.run(sockets=[sock])
    finally:
        engine.shutdown()
        sock.close()
