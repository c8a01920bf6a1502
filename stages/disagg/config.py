"""Settings shared by the prefill and decode sides, frozen and validated at start."""

from __future__ import annotations

from dataclasses import dataclass

from stages.engine.engine import Engine
from transfer.messages import Fingerprint, model_identity


@dataclass(frozen=True)
class DisaggConfig:
    bootstrap_host: str = "127.0.0.1"
    bootstrap_port: int = 0  # prefill only; 0 picks a free port
    pair_timeout_s: float = 10.0  # a room's other half (HTTP request or KV request) must arrive within this
    kv_timeout_s: float = 30.0  # decode: KV request sent -> KV ready (queueing + prefill + transfer)
    accept_timeout_s: float = 5.0  # decode: KV request sent -> accepted or rejected by the prefill
    abort_grace_s: float = 30.0  # decode: hold an aborted room's blocks this long if the prefill never confirms
    fault: str = ""  # test-only fault injection (EPD_TEST_FAULT), e.g. "prefill-exit-after-forward"

    def __post_init__(self) -> None:
        for name in ("pair_timeout_s", "kv_timeout_s", "accept_timeout_s", "abort_grace_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(self, name)}")
        if not 0 <= self.bootstrap_port < 65536:
            raise ValueError(f"--bootstrap-port must be in [0, 65535], got {self.bootstrap_port}")


def fingerprint(engine: Engine, backend: str) -> Fingerprint:
    """What P and D must agree on for P's KV bytes to mean the same thing in D's blocks."""
    config, layout = engine.adapter.config, engine.layout
    return Fingerprint(
        model=model_identity(config.model_type, config.to_dict()),
        backend=backend,
        dtype=engine.config.dtype,
        block_size=layout.block_size,
        num_layers=layout.num_layers,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        block_bytes=layout.block_bytes,
    )
