"""The pure judgement of a soak (unit-tested in tests/bench/test_overload.py): whether a process's
RSS, open fds or threads grew over the hold, the capacity found by the ramp, and the run's verdict.

Growth of one series (``growth``): only samples at or after the warm-up count; ``first`` is the
median of their first third, ``last`` the median of their last third, growth = last - first, and the
series fails when growth > its bound (RSS: ``max(rss_abs_mib, rss_rel * first)``; fds and threads: a
count: 32 and 8 by default, as connection pools and worker threads follow the requests
in flight). Medians of thirds, not the end points, so one sample taken mid-request does not decide; a
leak shows as a last third above the first. The least-squares slope per minute is reported too.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from bench.overload.analysis import summarize_outcomes

METRICS = ("rss_mib", "fds", "threads")
MIN_SAMPLES = 4  # post-warm-up samples a series needs to be judged


@dataclass(frozen=True)
class Bounds:
    """How much each metric may grow over a hold: RSS by ``max(rss_abs_mib, rss_rel * first)`` MiB,
    fds and threads by a count."""

    rss_abs_mib: float = 32.0
    rss_rel: float = 0.05
    fds: int = 32  # keep-alive pools follow the requests in flight: a plateau, not a leak, moves by that much
    threads: int = 8

    def of(self, metric: str, first: float) -> float:
        if metric == "rss_mib":
            return max(self.rss_abs_mib, self.rss_rel * first)
        return float(getattr(self, metric))


def series(samples: list[dict], name: str, metric: str) -> list[tuple[float, float]]:
    """(t, value) of ``metric`` of process ``name`` in each sample that has it."""
    return [(s["t"], s[name][metric]) for s in samples if s.get(name)]


def growth(points: list[tuple[float, float]], warmup_s: float, bound: Bounds, metric: str) -> dict:
    """The growth of one series after ``warmup_s`` (the module's docstring): {"n", "first", "last",
    "growth", "bound", "slope_per_min", "ok"}; ``ok`` False with ``reason`` when fewer than
    ``MIN_SAMPLES`` samples are past the warm-up."""
    kept = [(t, v) for t, v in points if t >= warmup_s]
    if len(kept) < MIN_SAMPLES:
        return {"n": len(kept), "ok": False, "reason": f"{len(kept)} samples after the warm-up, need {MIN_SAMPLES}"}
    third = max(1, len(kept) // 3)
    first = statistics.median(v for _, v in kept[:third])
    last = statistics.median(v for _, v in kept[-third:])
    limit = bound.of(metric, first)
    return {"n": len(kept), "first": round(first, 1), "last": round(last, 1), "growth": round(last - first, 1),
            "bound": round(limit, 1), "slope_per_min": round(slope(kept) * 60, 3), "ok": last - first <= limit}


def slope(points: list[tuple[float, float]]) -> float:
    """The least-squares slope of ``points`` (value per second); 0 for fewer than 2 distinct times."""
    n = len(points)
    mt = sum(t for t, _ in points) / n
    mv = sum(v for _, v in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    return sum((t - mt) * (v - mv) for t, v in points) / var if var else 0.0


def growth_table(samples: list[dict], names: list[str], warmup_s: float, bound: Bounds) -> dict[str, dict]:
    """{process: {metric: growth(...)}} for every process and metric."""
    return {name: {m: growth(series(samples, name, m), warmup_s, bound, m) for m in METRICS} for name in names}


def capacity(steps: list[dict]) -> float:
    """The ramp's capacity: the highest rate of 200s (``ok_per_s``) of any step; 0 for none."""
    return max((s["ok_per_s"] for s in steps), default=0.0)


def verdict(records: list[dict], table: dict[str, dict], capacity_per_s: float) -> dict:
    """The soak passes when the ramp found a capacity > 0, every answer of the hold is allowed (200,
    429 or 503 with Retry-After, a 200 whole: ``bench.overload.analysis.check_outcome``), at least one
    succeeded, and no series of ``table`` failed. {"ok", "reasons", "outcomes"}."""
    outcomes = summarize_outcomes(records)
    reasons = [] if capacity_per_s > 0 else ["the ramp measured no capacity"]
    if outcomes["bad_count"]:
        reasons.append(f"{outcomes['bad_count']} answers not 200, 429 or 503 with Retry-After")
    if not outcomes["by_status"].get("200"):
        reasons.append("no request succeeded")
    for name, metrics in table.items():
        for metric, g in metrics.items():
            if not g["ok"]:
                reasons.append(f"{name} {metric}: " + (g.get("reason") or f"grew {g['growth']} > {g['bound']}"))
    return {"ok": not reasons, "reasons": reasons, "outcomes": outcomes}
