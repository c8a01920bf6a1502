"""When each request is sent, as offsets in seconds from the start of a run. Pure."""

from __future__ import annotations

import math
import random

from bench.serve.config import Load


def offsets(n: int, load: Load) -> list[float]:
    """``n`` send offsets: the first at 0, then gaps drawn from a gamma distribution with shape
    ``load.burstiness`` and mean ``1 / load.request_rate`` (shape 1: exponential gaps, a Poisson
    process), seeded by ``load.seed``. The gaps are then scaled so that the last offset is exactly
    ``(n - 1) / rate``, as vllm does, so two seeds offer the same mean rate and differ only in how the
    requests bunch. ``request_rate = inf``: every offset is 0. ``burstiness = inf``: evenly spaced,
    ``i / rate`` (the gamma distribution's limit)."""
    if math.isinf(load.request_rate) or n <= 1:
        return [0.0] * n
    if math.isinf(load.burstiness):
        return [i / load.request_rate for i in range(n)]
    rng = random.Random(load.seed)
    scale = 1.0 / (load.request_rate * load.burstiness)
    out = [0.0]
    for _ in range(n - 1):
        out.append(out[-1] + rng.gammavariate(load.burstiness, scale))
    factor = (n - 1) / load.request_rate / out[-1] if out[-1] > 0 else 0.0
    return [t * factor for t in out]
