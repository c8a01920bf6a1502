"""Statistics the benchmark scripts share. Pure."""

from __future__ import annotations

import math
import statistics
from collections import Counter
from pathlib import Path


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank ``q`` quantile (0 < q <= 1) of ``values``."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def describe(values: list[float]) -> dict:
    """n, median, p90 (nearest rank), min and max of ``values`` (2 decimals); {"n": 0} for none."""
    if not values:
        return {"n": 0}
    return {"n": len(values), "median": round(statistics.median(values), 2), "p90": round(percentile(values, 0.9), 2),
            "min": round(min(values), 2), "max": round(max(values), 2)}


def ratio(numerator: float | None, denominator: float | None, digits: int = 3) -> float | None:
    """``numerator / denominator`` rounded to ``digits``; None when either is missing or the denominator is 0."""
    if numerator is None or not denominator:
        return None
    return round(numerator / denominator, digits)


def py_spy_summary(raw_path: Path, top: int = 25) -> dict:
    """Self time and inclusive time by function, and samples by thread, from py-spy's raw (collapsed)
    output, in percent of all samples."""
    return collapsed_summary(raw_path.read_text(errors="replace").splitlines(), top)


def collapsed_summary(lines: list[str], top: int = 25) -> dict:
    """``py_spy_summary`` of the lines of a collapsed-stack file (``thread;frame;...;frame COUNT``)."""
    own: Counter = Counter()
    inclusive: Counter = Counter()
    threads: Counter = Counter()
    total = 0
    for line in lines:
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = stack.split(";")
        threads[frames[0]] += n
        own[frames[-1]] += n
        for frame in set(frames[1:]):
            inclusive[frame] += n

    def pct(counter: Counter) -> list[list]:
        return [[name, round(100 * n / total, 1)] for name, n in counter.most_common(top)]

    return {"samples": total, "threads_pct": pct(threads), "self_pct": pct(own), "inclusive_pct": pct(inclusive)}
