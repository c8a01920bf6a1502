"""``stage serve colocated``: encode, prefill and decode in one process, one engine, no transfer.

The baseline for every comparison and the reference for parity tests.
"""

from __future__ import annotations

from contextlib import asynccontextmanager

from fastapi import FastAPI

from contract.paths import SERVER_INFO_PATH
from stages.config import ServerConfig


def build(config: ServerConfig) -> FastAPI:
    """Load the model (both halves) and build the app; its lifespan starts and stops the engine thread."""
    from stages.api.chat import ImageMode, Preparer
    from stages.api.videos import published
    from stages.api.lifetime import run_whole
    from stages.api.routes import create_app
    from stages.api.app_config import AppParts, app_config
    from stages.engine.async_engine import AsyncEngine
    from stages.faults.seams import seams_for
    from stages.generation_defaults import generation_info
    from stages.loading import load_engine
    from stages.metrics import Metrics
    from stages.resources import engine_info, limits_info, model_info
    from stages.supervisor import Supervisor

    metrics, supervisor, seams = Metrics(), Supervisor(), seams_for(config.debug_faults)
    engine, prompts = load_engine(config.engine, pixels=True)
    async_engine = AsyncEngine(engine, on_step=metrics.observe_step, before_step=seams.before_step())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start()
        try:
            yield
        finally:
            await supervisor.stop()
            async_engine.shutdown()

    generate = run_whole(async_engine)
    if config.tracing.enabled:  # the request's span gets its token counts and finish reason (stages.tracing)
        from stages.tracing import traced_outputs
        generate = traced_outputs(generate)
    parts = AppParts(async_engine, Preparer(prompts, async_engine, config.limits, ImageMode.PIXELS, config.video,
                                          metrics.observe_video_decode, metrics.images_preprocess_skipped.inc),
                     generate=seams.generate(generate), metrics=metrics, supervisor=supervisor,
                     lifespan=lifespan, tokenizer=prompts.tokenizer)
    app = create_app(parts, app_config(config, prompts, "colocated"))
    seams.install(app)

    @app.get(SERVER_INFO_PATH)
    async def server_info() -> dict:
        stats = async_engine.stats()
        return {"role": "colocated", "model": config.model_name, "model_path": config.engine.model,
                **generation_info(config.engine.generation_config, prompts.defaults),
                **model_info(engine.adapter, images="pixels"), "limits": limits_info(config, engine.max_model_len, prompts.chars_per_token),
                "video": published(prompts.video, config.video),
                "kv_blocks": {"used": stats.blocks_used, "total": stats.blocks_total, "cached": stats.blocks_cached},
                "engine": engine_info(async_engine)}

    return app
