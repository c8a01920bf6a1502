"""The numbers of a run from its Outcomes: per phase the streams' TPOT and ITL percentiles and the
arrivals' TTFT, each phase's TPOT p99 and ITL p99 over the phase without arrivals (the ratios
bench/README.md quotes), the goal, and the lone long prompt's TTFT. Pure; tested in
tests/bench/test_chunked_prefill.py."""

from __future__ import annotations

import statistics

from bench.common.stats import ratio
from bench.serve.client import Outcome
from bench.serve.metrics import latency_stats

GOAL_RATIO = 2.0  # the goal: TPOT p99 with arrivals, chunked, <= 2x TPOT p99 without arrivals
BASELINE = "alone"  # the phase without arrivals
CHUNKED = "chunked"  # the phase with arrivals at the server's default --max-batched-tokens


def tpot(outcome: Outcome) -> float | None:
    """``(e2el - ttft) / (output tokens - 1)``, vLLM's per-request TPOT; None for a failed request or one
    with a single token."""
    if not outcome.ok or outcome.ttft is None or not outcome.output_tokens or outcome.output_tokens < 2:
        return None
    return (outcome.latency - outcome.ttft) / (outcome.output_tokens - 1)


def pool(rounds: list[dict]) -> dict:
    """One phase's rounds (``client.run_load`` results) as one: the streams and arrivals of every round,
    the arrivals' send times per round, the wall times added."""
    return {"streams": [outcomes for r in rounds for outcomes in r["streams"]],
            "longs": [o for r in rounds for o in r["longs"]],
            "long_sent_at_s": [r["long_sent_at_s"] for r in rounds], "wall_s": round(sum(r["wall_s"] for r in rounds), 2)}


def load_stats(result: dict) -> dict:
    """One phase's figures (its rounds pooled): the streams' requests give TPOT per request and every
    inter-token gap (ITL, pooled); the arrivals give their TTFT and prompt length; failures are
    counted, each side apart."""
    measured = [o for outcomes in result["streams"] for o in outcomes]
    tpots = [t for t in map(tpot, measured) if t is not None]
    itls = [gap for o in measured if o.ok for gap in o.itl]
    longs = result["longs"]
    long_ttft = [o.ttft for o in longs if o.ok and o.ttft is not None]
    return {"stream_requests": len(measured), "stream_failed": sum(not o.ok for o in measured),
            "stream_errors": sorted({o.error for o in measured if o.error}),
            **latency_stats("tpot", tpots), **latency_stats("itl", itls), "max_itl_ms": _max_ms(itls),
            "arrivals": len(longs), "arrivals_failed": sum(not o.ok for o in longs),
            "arrival_errors": sorted({o.error for o in longs if o.error}),
            "arrival_prompt_tokens": [o.prompt_tokens for o in longs], "arrival_sent_at_s": result["long_sent_at_s"],
            **latency_stats("arrival_ttft", long_ttft), "wall_s": result["wall_s"]}


def tpot_and_gaps(replay: dict) -> dict:
    """The figures of an engine replay (``replay.run``): each stream request's stamps ``[sent, token,
    token, ...]`` give its TPOT (last - first token over tokens - 1) and its gaps (ITL, pooled); the long
    prompts' ``(sent, first token)`` their TTFT; seconds of the engine's CPU clock, in ms."""
    requests = [stamps[1:] for outcomes in replay["streams"] for stamps in outcomes if len(stamps) > 2]
    tpots = [(tokens[-1] - tokens[0]) / (len(tokens) - 1) for tokens in requests]
    gaps = [b - a for tokens in requests for a, b in zip(tokens, tokens[1:])]
    return {"stream_requests": len(requests), **latency_stats("tpot", tpots), **latency_stats("itl", gaps),
            "max_itl_ms": _max_ms(gaps), "arrivals": len(replay["longs"]),
            **latency_stats("arrival_ttft", [first - sent for sent, first in replay["longs"]]),
            "clock_s": round(replay["clock_s"], 2)}


def replay_ratios(phases: dict[str, dict]) -> dict[str, dict[str, float | None]]:
    """Each replayed phase with arrivals over the replayed baseline: TPOT p99 and ITL p99."""
    base = phases[BASELINE]
    return {name: {"tpot_p99": ratio(p["p99_tpot_ms"], base["p99_tpot_ms"]),
                   "itl_p99": ratio(p["p99_itl_ms"], base["p99_itl_ms"])}
            for name, p in phases.items() if name != BASELINE}


def lone_stats(outcomes: list[Outcome]) -> dict:
    """A lone long prompt's TTFT over its requests (the first is a warm-up, left out): median, min, all."""
    timed = [o for o in outcomes[1:] if o.ok and o.ttft is not None]
    ttfts = [1e3 * (o.ttft or 0.0) for o in timed]
    return {"requests": len(outcomes) - 1, "failed": sum(not o.ok for o in outcomes),
            "prompt_tokens": timed[0].prompt_tokens if timed else None,
            "ttft_ms_median": round(statistics.median(ttfts), 2) if ttfts else None,
            "ttft_ms_min": round(min(ttfts), 2) if ttfts else None, "ttft_ms_all": [round(t, 2) for t in ttfts]}


def ratios(phases: dict[str, dict]) -> dict[str, dict[str, float | None]]:
    """Each phase with arrivals over the baseline: TPOT p99, ITL p99, lone-prompt TTFT median (the last
    over the unchunked server's, where there is one)."""
    base = phases[BASELINE]["load"]
    unchunked = phases.get("unchunked", {}).get("lone", {}).get("ttft_ms_median")
    return {name: {"tpot_p99": ratio(p["load"]["p99_tpot_ms"], base["p99_tpot_ms"]),
                   "itl_p99": ratio(p["load"]["p99_itl_ms"], base["p99_itl_ms"]),
                   "lone_ttft_vs_unchunked": ratio((p.get("lone") or {}).get("ttft_ms_median"), unchunked)}
            for name, p in phases.items() if name != BASELINE}


def goal(by_phase: dict[str, dict[str, float | None]]) -> dict:
    """Whether the chunked phase's TPOT p99 is within ``GOAL_RATIO`` of the baseline's (None: not run)."""
    value = (by_phase.get(CHUNKED) or {}).get("tpot_p99")
    return {"ratio": GOAL_RATIO, "metric": f"p99 TPOT {CHUNKED} / {BASELINE}", "value": value,
            "met": None if value is None else value <= GOAL_RATIO}


def problems(phases: dict[str, dict]) -> list[str]:
    """What makes a run's figures unfit to record: failed requests, a phase without measured requests,
    a phase meant to have arrivals that had none."""
    out = []
    for name, p in phases.items():
        load = p["load"]
        if load["stream_failed"] or load["arrivals_failed"]:
            out.append(f"{name}: {load['stream_failed']} stream and {load['arrivals_failed']} arriving requests "
                       f"failed: {load['stream_errors'] + load['arrival_errors']}")
        if load["p99_tpot_ms"] is None:
            out.append(f"{name}: no stream request measured")
        if name != BASELINE and not load["arrivals"]:
            out.append(f"{name}: no long prompt arrived (the streams ended before the first period)")
        if (p.get("lone") or {}).get("failed"):
            out.append(f"{name}: {p['lone']['failed']} lone long prompts failed")
    return out


def _max_ms(seconds: list[float]) -> float | None:
    return round(1e3 * max(seconds), 3) if seconds else None
