"""Start-up shared by the prefill and decode servers: the engine and its prompt builder, the transfer
backend, the fingerprint (with the prompt builder's sampling defaults)."""

from __future__ import annotations

from dataclasses import dataclass

from stages.engine.async_engine import AsyncEngine
from stages.engine.config import EngineConfig
from stages.engine.engine import Engine
from stages.faults.seams import Seams
from stages.generation_defaults import GenerationDefaults
from stages.loading import load_engine
from stages.prompt import PromptBuilder
from transfer.base import TransferBackend, TransferConfig
from transfer.fingerprint import Fingerprint, model_identity
from transfer.registry import create_backend


@dataclass
class StageRuntime:
    """What a prefill or decode process owns for its whole life. ``close()`` releases it in order."""

    engine: AsyncEngine
    prompts: PromptBuilder
    backend: TransferBackend
    fingerprint: Fingerprint

    def close(self) -> None:
        self.engine.shutdown()
        self.backend.release()  # after the engine stops: the pool stays allocated until then


def start_runtime(engine_config: EngineConfig, transfer: str, transfer_config: TransferConfig, *, pixels: bool,
                  seams: Seams, on_step=None) -> StageRuntime:
    """Load the model and its prompt builder (``pixels``: see ``stages.loading``), allocate the KV
    pool, register it once with the transfer backend. ``on_step`` is the ``AsyncEngine``'s hook;
    ``seams`` gives its ``before_step`` and wraps the backend (``stages.faults.seams``)."""
    engine, prompts = load_engine(engine_config, pixels=pixels)
    backend = seams.backend(create_backend(transfer, transfer_config))
    backend.register(engine.pool.data_ptr, engine.pool.nbytes, engine.pool.memory, engine.pool.device_id)
    return StageRuntime(AsyncEngine(engine, on_step=on_step, before_step=seams.before_step()), prompts, backend,
                        fingerprint(engine, transfer, prompts.defaults))


def fingerprint(engine: Engine, backend: str, defaults: GenerationDefaults) -> Fingerprint:
    """What P and D must agree on for P's KV bytes to mean the same thing in D's blocks, and for P's
    first token to be sampled as D samples the rest (``defaults``: the checkpoint's sampling defaults)."""
    config, layout = engine.adapter.config, engine.layout
    return Fingerprint(
        model=model_identity(config.model_type, config.to_dict()),
        backend=backend,
        dtype=engine.dtype.name,
        block_size=layout.block_size,
        num_layers=layout.num_layers,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        block_bytes=layout.block_bytes,
        memory=engine.pool.memory,
        generation_defaults=defaults.key(),
    )
