"""Pure: the statistics the tables quote, and the router's CPU figures of a phase."""

from __future__ import annotations

import statistics

from bench.common.stats import percentile


def timing(seconds: list[float]) -> dict:
    """n, median and p99 (nearest rank) and max of ``seconds``, in microseconds (3 significant digits);
    {"n": 0} for none."""
    if not seconds:
        return {"n": 0}
    us = [s * 1e6 for s in seconds]
    return {"n": len(us), "median_us": _round(statistics.median(us)), "p99_us": _round(percentile(us, 0.99)),
            "max_us": _round(max(us))}


def _round(value: float) -> float:
    return float(f"{value:.3g}")


def idle_cores(cpu_s: float, wall_s: float) -> float | None:
    """CPU seconds per second of wall time (cores busy); None for no wall time."""
    return round(cpu_s / wall_s, 4) if wall_s > 0 else None


def per_request(cpu_s: float, wall_s: float, answered: int, idle: float | None) -> dict:
    """A traffic phase's router CPU per answered request in ms: all of it, and less what the idle rate
    (``idle`` cores: health checks and scrapes) accounts for over the phase's wall time."""
    if answered <= 0:
        return {"answered": answered, "cpu_ms": None, "net_cpu_ms": None}
    net = cpu_s - (idle or 0.0) * wall_s
    return {"answered": answered, "cpu_ms": round(1000 * cpu_s / answered, 3),
            "net_cpu_ms": round(1000 * max(net, 0.0) / answered, 3), "requests_per_s": round(answered / wall_s, 1)}


def growth(values: dict[int, float | None]) -> float | None:
    """The largest size's value over the smallest's (how a figure grows with the fleet); None if either
    is missing or the smallest is 0."""
    sizes = sorted(values)
    first, last = values[sizes[0]], values[sizes[-1]]
    if first is None or last is None or not first:
        return None
    return round(last / first, 2)
