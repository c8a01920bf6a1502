"""The numbers of a cell from its timings: each path's median, p90 and min time and GB/s (1 GB = 1e9
B), ours / raw and each path / memcpy as bandwidth ratios (time of the reference over the path's:
the ratios bench/README.md quotes), ours - raw split into the thread hop and the rest; and the goal.
Pure; tested in tests/bench/test_kv_transfer.py."""

from __future__ import annotations

import statistics

from bench.common.stats import percentile

GOAL_RATIO = 0.9  # ours / raw, bandwidth at the median


def summarize(times_s: list[float], nbytes: int) -> dict:
    """One path's timings of moving ``nbytes``: n, median/p90/min ms, GB/s at the median and at the p90 time."""
    median = statistics.median(times_s)
    return {"n": len(times_s), "median_ms": round(1e3 * median, 4), "p90_ms": round(1e3 * percentile(times_s, 0.9), 4),
            "min_ms": round(1e3 * min(times_s), 4), "gbps": round(nbytes / median / 1e9, 3),
            "gbps_p90_time": round(nbytes / percentile(times_s, 0.9) / 1e9, 3)}


def cell_ratios(res: dict[str, dict]) -> dict:
    """From a cell's path summaries: ``ratio_ours_vs_raw`` (raw median time / ours: ours' share of raw's
    bandwidth), the same of the minima, ``ratio_vs_memcpy`` per path, ``ours_minus_raw_us`` and, with
    ``raw_in_thread``, ``split_us`` (thread hop = raw_in_thread - raw, rest of our layer = ours - raw_in_thread)."""
    out = {"ratio_ours_vs_raw": round(res["raw"]["median_ms"] / res["ours"]["median_ms"], 3),
           "ratio_ours_vs_raw_best": round(res["raw"]["min_ms"] / res["ours"]["min_ms"], 3),
           "ratio_vs_memcpy": {p: round(res["memcpy"]["median_ms"] / r["median_ms"], 3)
                               for p, r in res.items() if p != "memcpy"},
           "ours_minus_raw_us": round(1e3 * (res["ours"]["median_ms"] - res["raw"]["median_ms"]), 1)}
    if "raw_in_thread" in res:
        out["split_us"] = {
            "thread_hop": round(1e3 * (res["raw_in_thread"]["median_ms"] - res["raw"]["median_ms"]), 1),
            "rest_of_layer": round(1e3 * (res["ours"]["median_ms"] - res["raw_in_thread"]["median_ms"]), 1)}
    return out


def goal(results: list[dict]) -> dict:
    """ours / raw of every cell (``backend/tokens/layout``), whether all reach ``GOAL_RATIO``, and those below."""
    ratios = {f"{r['backend']}/{c['tokens']}/{c['layout']}": c["ratio_ours_vs_raw"] for r in results for c in r["cells"]}
    return {"ratio_ours_vs_raw": GOAL_RATIO, "ratios": ratios, "met": all(v >= GOAL_RATIO for v in ratios.values()),
            "below": {k: v for k, v in ratios.items() if v < GOAL_RATIO}}
