"""A run's Outcomes -> its result dict. Pure.

Keys follow ``vllm bench serve``'s result JSON where they measure the same thing: ``duration``,
``completed``, ``failed``, ``total_input_tokens``, ``total_output_tokens``, ``request_throughput``,
``request_goodput``, ``output_throughput``, ``total_token_throughput`` and, for each of ``ttft``,
``tpot``, ``itl``, ``e2el``: ``mean_X_ms``, ``median_X_ms``, ``std_X_ms``, ``pNN_X_ms``. Definitions are
vllm's: TTFT send -> first token chunk; TPOT per request ``(e2el - ttft) / (output tokens - 1)`` over
requests with more than one output token; ITL every gap between token chunks, pooled over requests;
E2EL send -> end of the stream; percentiles by linear interpolation (numpy's default); a request is
*good* when it completed and meets every SLO given (TPOT counts as 0 with one output token). A latency
with no sample (every request failed) is None, not 0.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from bench.serve.client import Outcome
from bench.serve.config import Slo
from bench.serve.tokens import Counts

PERCENTILES = (50, 90, 99)
LATENCIES = ("ttft", "tpot", "itl", "e2el")


def latency_stats(name: str, seconds: list[float]) -> dict[str, float | None]:
    """``mean_/median_/std_/p50_/p90_/p99_<name>_ms`` of ``seconds`` (None each when empty)."""
    keys = [f"mean_{name}_ms", f"median_{name}_ms", f"std_{name}_ms", *(f"p{p}_{name}_ms" for p in PERCENTILES)]
    if not seconds:
        return dict.fromkeys(keys)
    ms = np.asarray(seconds, dtype=float) * 1e3
    values = [ms.mean(), np.median(ms), ms.std(), *np.percentile(ms, PERCENTILES)]
    return {key: round(float(value), 3) for key, value in zip(keys, values)}


def per_request(outcomes: list[Outcome], counts: Counts) -> dict[str, list[float]]:
    """The samples behind each latency, in seconds: ``ttft``, ``tpot``, ``itl`` (pooled), ``e2el``; only
    completed requests count."""
    samples: dict[str, list[float]] = {name: [] for name in LATENCIES}
    for outcome, tokens in zip(outcomes, counts.output_tokens):
        if not outcome.ok:
            continue
        samples["e2el"].append(outcome.latency)
        samples["itl"] += outcome.itl
        if outcome.ttft is not None:
            samples["ttft"].append(outcome.ttft)
            if tokens > 1:
                samples["tpot"].append((outcome.latency - outcome.ttft) / (tokens - 1))
    return samples


def is_good(outcome: Outcome, tokens: int, slo: Slo) -> bool:
    """Completed and within every SLO given (no first token: misses a TTFT SLO)."""
    if not outcome.ok:
        return False
    if slo.e2el_ms is not None and outcome.latency * 1e3 > slo.e2el_ms:
        return False
    if slo.ttft_ms is not None and (outcome.ttft is None or outcome.ttft * 1e3 > slo.ttft_ms):
        return False
    if slo.tpot_ms is not None and tokens > 1 and outcome.ttft is not None:
        if (outcome.latency - outcome.ttft) / (tokens - 1) * 1e3 > slo.tpot_ms:
            return False
    return True


def summarize(outcomes: list[Outcome], counts: Counts, duration: float, slo: Slo) -> dict:
    """The result of one run (see the module docstring), plus ``failure_reasons`` (message -> count, most
    common first), ``good_requests`` and ``slo`` (None without --slo)."""
    ok = [i for i, o in enumerate(outcomes) if o.ok]
    total_in = sum(counts.input_tokens[i] for i in ok)
    total_out = sum(counts.output_tokens[i] for i in ok)
    good = sum(is_good(o, t, slo) for o, t in zip(outcomes, counts.output_tokens)) if slo.given() else None
    result: dict = {
        "duration": round(duration, 4),
        "completed": len(ok),
        "failed": len(outcomes) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": round(len(ok) / duration, 4) if duration > 0 else None,
        "request_goodput": round(good / duration, 4) if good is not None and duration > 0 else None,
        "output_throughput": round(total_out / duration, 4) if duration > 0 else None,
        "total_token_throughput": round((total_in + total_out) / duration, 4) if duration > 0 else None,
    }
    samples = per_request(outcomes, counts)
    for name in LATENCIES:
        result.update(latency_stats(name, samples[name]))
    result["good_requests"] = good
    result["slo"] = slo.given() or None
    result["failure_reasons"] = dict(Counter(o.error for o in outcomes if not o.ok).most_common())
    result["token_counts"] = counts.sources
    return result
