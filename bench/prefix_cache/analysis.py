"""The numbers of a run from its phases: per mode and turn the TTFT medians with prefix caching on
and off, on / off, the goal, and whether on and off answered alike. Pure; tested in
tests/bench/test_prefix_cache.py."""

from __future__ import annotations

import statistics

GOAL_RATIO = 0.3  # turns GOAL_FROM_TURN and later: TTFT on / off at or under this
GOAL_FROM_TURN = 3


def per_turn(phases: list[dict]) -> dict[int, dict]:
    """The phases' (one system's, rounds pooled) samples by turn: TTFT median and min (ms), prompt and
    cached tokens (medians), how many samples."""
    by_turn: dict[int, list[dict]] = {}
    for phase in phases:
        for samples in phase["conversations"]:
            for sample in samples:
                by_turn.setdefault(sample["turn"], []).append(sample)
    out = {}
    for turn, samples in sorted(by_turn.items()):
        out[turn] = {"n": len(samples),
                     "ttft_ms_median": round(1e3 * statistics.median(s["ttft_s"] for s in samples), 2),
                     "ttft_ms_min": round(1e3 * min(s["ttft_s"] for s in samples), 2),
                     "prompt_tokens": statistics.median(s["prompt_tokens"] for s in samples),
                     "cached_tokens": statistics.median(s["cached_tokens"] for s in samples)}
        prefill = [s["prefill_s"] for s in samples if s.get("prefill_s") is not None]
        if prefill:  # epd: the prefill's forward pass alone (its room timeline)
            out[turn]["prefill_ms_median"] = round(1e3 * statistics.median(prefill), 2)
    return out


def texts(phases: list[dict]) -> list[list[str]]:
    """Every conversation's answers, in order (round by round)."""
    return [[s["text"] for s in samples] for phase in phases for samples in phase["conversations"]]


def summarize(phases: list[dict]) -> dict[str, dict]:
    """Per mode: each turn with prefix caching on and off, on / off of the TTFT medians, the goal
    (every turn from ``GOAL_FROM_TURN`` at or under ``GOAL_RATIO``), the same texts on and off."""
    out = {}
    for mode in dict.fromkeys(p["mode"] for p in phases):
        on = [p for p in phases if p["mode"] == mode and p["prefix_caching"]]
        off = [p for p in phases if p["mode"] == mode and not p["prefix_caching"]]
        if not on or not off:
            continue
        turns_on, turns_off = per_turn(on), per_turn(off)
        ratios = {turn: round(turns_on[turn]["ttft_ms_median"] / turns_off[turn]["ttft_ms_median"], 3)
                  for turn in turns_on if turn in turns_off}
        prefill = {turn: round(turns_on[turn]["prefill_ms_median"] / turns_off[turn]["prefill_ms_median"], 3)
                   for turn in ratios if "prefill_ms_median" in turns_on[turn] and "prefill_ms_median" in turns_off[turn]}
        late = [r for turn, r in ratios.items() if turn >= GOAL_FROM_TURN]
        out[mode] = {"on": turns_on, "off": turns_off, "ratio_on_off": ratios, "prefill_ratio_on_off": prefill,
                     "worst_ratio_from_turn_3": max(late) if late else None,
                     "goal_met": bool(late) and max(late) <= GOAL_RATIO,
                     "same_texts": texts(on) == texts(off)}
    return out
