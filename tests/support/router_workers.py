"""Router workers for the router's unit tests: a known, healthy worker of a role with a
one-failure breaker, and round-robin prefill/decode pools over them."""

from __future__ import annotations

from router.fleet.breaker import CircuitBreaker
from router.fleet.workers import Pool, Worker
from router.plan.policy import RoundRobin

FP = {"model": "qwen2_vl-abc", "backend": "mooncake", "dtype": "float32", "block_size": 16}


def worker(url: str, role: str, fingerprint: dict | None = FP, healthy: bool = True) -> Worker:
    w = Worker(url, role, CircuitBreaker(1, 10.0), healthy=healthy, models=("m",), fingerprint=fingerprint,
               bootstrap=("127.0.0.1", 9000) if role == "prefill" else None, known=True)
    return w


def pools(prefills: list[Worker], decodes: list[Worker]) -> tuple[Pool, Pool]:
    return Pool("prefill", prefills, RoundRobin()), Pool("decode", decodes, RoundRobin())
