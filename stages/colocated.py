"""``stage serve colocated``: encode, prefill and decode in one process, one engine, no transfer.

The baseline for every comparison and the reference for parity tests.
"""

from __future__ import annotations

from contextlib import asynccontextmanager

from fastapi import FastAPI

from stages.config import ServerConfig


def build(config: ServerConfig) -> FastAPI:
    """Load the model and build the app; its lifespan starts and stops the engine thread."""
    from stages.api.routes import create_app
    from stages.engine.async_engine import AsyncEngine
    from stages.engine.engine import Engine
    from stages.faults import Faults, engine_hook
    from stages.metrics import Metrics
    from stages.supervisor import Supervisor

    metrics, supervisor, faults = Metrics(), Supervisor(), Faults(config.debug_faults)
    engine = AsyncEngine(Engine(config.engine), on_step=metrics.observe_step, before_step=engine_hook(faults))

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        try:
            yield
        finally:
            await supervisor.stop()
            engine.shutdown()

    return create_app(engine, model_name=config.model_name, limits=config.limits, metrics=metrics,
                      lifespan=lifespan, max_body_bytes=config.max_body_bytes, max_in_flight=config.max_in_flight,
                      supervisor=supervisor, faults=faults)
