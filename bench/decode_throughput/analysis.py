"""The numbers of a run from its timed runs: the best run of each side (highest tokens/s; runs on a
shared machine differ by outside load, the best is the least disturbed), ours / HF at each level (the
ratios bench/README.md quotes) and the goal. Pure; tested in tests/bench/test_decode_throughput.py."""

from __future__ import annotations

TARGET_RATIO = 8.0  # the goal: ours / HF generate() at 32 streams
GOAL_STREAMS = 32


def best_hf(runs: list[dict], load_s: float) -> dict:
    """The HF baseline's best run (highest tokens/s) with the best tokens per CPU second of any run,
    the load time and every run without its per-request rows."""
    best = dict(max(runs, key=lambda r: r["tokens_per_s"]))
    best["tokens_per_cpu_s"] = max(r["tokens_per_cpu_s"] for r in runs)
    best.update(load_s=round(load_s, 2), runs=[{k: v for k, v in r.items() if k != "per_request"} for r in runs])
    return best


def best_level(runs: list[dict], hf: dict) -> dict:
    """One concurrency level: its best run (highest tokens/s), the best tokens per server CPU second of
    any run, ``ratio_vs_hf`` (tokens/s over HF's) and, where the CPU is known,
    ``cpu_normalized_ratio_vs_hf`` (tokens per CPU second over HF's); every run kept under ``runs``."""
    level = dict(max(runs, key=lambda r: r["tokens_per_s"]))
    level["tokens_per_server_cpu_s"] = max((r["tokens_per_server_cpu_s"] or 0) for r in runs) or None
    level["ratio_vs_hf"] = round(level["tokens_per_s"] / hf["tokens_per_s"], 2)
    if level["tokens_per_server_cpu_s"]:
        level["cpu_normalized_ratio_vs_hf"] = round(level["tokens_per_server_cpu_s"] / hf["tokens_per_cpu_s"], 2)
    level["runs"] = runs
    return level


def goal(levels: list[dict]) -> dict:
    """Whether ours reached ``TARGET_RATIO`` x HF at ``GOAL_STREAMS`` streams, by wall clock and per CPU
    second (None for both when that level was not run)."""
    at = next((level for level in levels if level["concurrency"] == GOAL_STREAMS), None)
    return {"ratio": TARGET_RATIO, "at_streams": GOAL_STREAMS,
            "met": None if at is None else at["ratio_vs_hf"] >= TARGET_RATIO,
            "met_cpu_normalized": None if at is None else (at.get("cpu_normalized_ratio_vs_hf") or 0) >= TARGET_RATIO}
