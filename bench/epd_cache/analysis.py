"""The numbers of a run from its samples: whether a miss's prefill waited and its wake (``wake``),
TTFT and CPU medians per system, N and case, hit / miss and epd / colocated ratios (the ones
bench/README.md quotes), encoder calls per unique image, wake statistics, the goals. Pure; tested in
tests/bench/test_epd_cache.py."""

from __future__ import annotations

import statistics

from bench.common.stats import describe

ROLES = {"epd": ("encoder", "prefill", "decode"), "colocated": ("colocated",)}
WAKE_GOAL_MS = 2.0
HIT_GOAL = 0.5


def wake(reply: dict, events: dict[str, float]) -> dict:
    """The miss's wake figures: did the prefill wait for the last image (its cache misses moved, and it
    was queued, when its read starts, before that image landed), and from its landing (``wake_ms``) and from its
    entry's ``created_at`` (the encoder's clock before it sent the write: an upper bound;
    ``wake_upper_ms``) to ``embeddings_ready``, in ms."""
    ready, landed = events.get("embeddings_ready"), reply["landed_at"] or reply["created_at"]
    if reply["case"] != "miss" or ready is None or landed is None:
        return {"waited": False}
    waited = reply["prefill_cache_misses"] > 0 and events.get("queued", 1e18) <= landed
    out = {"waited": waited, "wake_upper_ms": round(1e3 * (ready - reply["created_at"]), 3),
           "queued_before_landing_ms": round(1e3 * (landed - events.get("queued", landed)), 3)}
    if reply["landed_at"] is not None:
        out["wake_ms"] = round(1e3 * (ready - reply["landed_at"]), 3)
    return out


def summarize(runs: dict[str, list[dict]], counts: list[int]) -> dict:
    """Per system, N and case: TTFT stats (ms), the stage servers' CPU ms per request (median of their
    sum, and per process: router and Redis apart), prompt tokens; epd: encoder and wake figures."""
    out: dict = {"ttft_ms": {}, "cpu_ms": {}, "prompt_tokens": {}}
    for mode, mode_runs in runs.items():
        timed = [s for run in mode_runs for s in run["samples"] if not s["warmup"]]
        for n in counts:
            for case in ("miss", "hit"):
                mine = [s for s in timed if s["n"] == n and s["case"] == case]
                out["ttft_ms"].setdefault(mode, {}).setdefault(str(n), {})[case] = describe([1e3 * s["ttft_s"] for s in mine])
                out["cpu_ms"].setdefault(mode, {}).setdefault(str(n), {})[case] = {
                    "stages_median": statistics.median(sum(s["cpu_ms"][r] for r in ROLES[mode]) for s in mine),
                    **{r: statistics.median(s["cpu_ms"][r] for s in mine) for r in mine[0]["cpu_ms"]}} if mine else {}
            out["prompt_tokens"][str(n)] = next((s["prompt_tokens"] for s in timed if s["n"] == n), None)
    epd = [s for run in runs.get("epd", []) for s in run["samples"]]
    if epd:
        out.update(_epd_summary(runs, epd, counts))
        cpu = out["cpu_ms"]["epd"]
        out["ratio_hit_vs_miss_cpu"] = {str(n): round(cpu[str(n)]["hit"]["stages_median"]
                                                      / cpu[str(n)]["miss"]["stages_median"], 3) for n in counts}
    return out


def _epd_summary(runs: dict[str, list[dict]], epd: list[dict], counts: list[int]) -> dict:
    timed = [s for s in epd if not s["warmup"]]
    ttft = {n: {c: statistics.median(1e3 * s["ttft_s"] for s in timed if s["n"] == n and s["case"] == c)
                for c in ("miss", "hit")} for n in counts}
    ratios = {str(n): round(ttft[n]["hit"] / ttft[n]["miss"], 3) for n in counts}
    # each hit against its own miss, sent 0.25 s before it: outside load drifting over a run cancels
    misses = {(s["round"], s["n"], s["index"]): s["ttft_s"] for s in timed if s["case"] == "miss"}
    paired = {str(n): describe([s["ttft_s"] / misses[(s["round"], n, s["index"])] for s in timed
                           if s["n"] == n and s["case"] == "hit"]) for n in counts}
    coloc = [s for run in runs.get("colocated", []) for s in run["samples"] if not s["warmup"]]
    vs_coloc = {}
    if coloc:
        for n in counts:
            base = statistics.median(1e3 * s["ttft_s"] for s in coloc if s["n"] == n)
            vs_coloc[str(n)] = {c: round(ttft[n][c] / base, 3) for c in ("miss", "hit")}
    # encoder calls: over the TTFT workload (each miss image once; hits must add nothing), and the bursts
    ttft_unique = sum(s["n"] for s in epd if s["case"] == "miss")
    ttft_encoded = sum(s["encoded"] for s in epd)
    bursts = [run["burst"] for run in runs["epd"] if run["burst"]]
    burst_unique = sum(b["unique_images"] for b in bursts)
    burst_encoded = sum(b["encoded"] for b in bursts)
    wrong = [{"n": s["n"], "case": s["case"], "room": s["room"], "encoded": s["encoded"]} for s in epd
             if s["encoded"] != (s["n"] if s["case"] == "miss" else 0)]
    waited = [s for s in epd if s["case"] == "miss" and s.get("waited")]
    wake = {"all": describe([s["wake_ms"] for s in waited if "wake_ms" in s]),
            "upper_bound": describe([s["wake_upper_ms"] for s in waited]),
            "per_n": {str(n): describe([s["wake_ms"] for s in waited if s["n"] == n and "wake_ms" in s]) for n in counts},
            "upper_bound_per_n": {str(n): describe([s["wake_upper_ms"] for s in waited if s["n"] == n]) for n in counts},
            "misses": sum(1 for s in epd if s["case"] == "miss"), "waited": len(waited),
            "not_waited": [{"n": s["n"], "room": s["room"], "prefill_cache_misses": s["prefill_cache_misses"],
                            "queued_before_landing_ms": s.get("queued_before_landing_ms")}
                           for s in epd if s["case"] == "miss" and not s.get("waited")]}
    hit_read = [1e3 * (s["prefill_events"]["embeddings_ready"] - s["prefill_events"]["queued"])
                for s in epd if s["case"] == "hit" and {"queued", "embeddings_ready"} <= s["prefill_events"].keys()]
    return {
        "ratio_hit_vs_miss": ratios,
        "ratio_hit_vs_miss_paired": paired,
        "ratio_epd_vs_colocated": vs_coloc,
        "encoder_calls": {
            "ttft_workload": {"unique_images": ttft_unique, "encoded": ttft_encoded,
                              "calls_per_unique_image": round(ttft_encoded / ttft_unique, 4) if ttft_unique else None},
            "burst": {"unique_images": burst_unique, "encoded": burst_encoded,
                      "calls_per_unique_image": round(burst_encoded / burst_unique, 4) if burst_unique else None,
                      "runs": bursts},
            "overall_calls_per_unique_image": round((ttft_encoded + burst_encoded) / (ttft_unique + burst_unique), 4),
            "requests_with_a_wrong_count": wrong},
        "wake_ms": wake,
        "hit_queued_to_embeddings_ready_ms": describe(hit_read),
    }


def same_texts(runs: dict[str, list[dict]]) -> dict:
    """Whether epd answered each body with the colocated server's text (greedy: identical expected)."""
    if not runs.get("colocated") or not runs.get("epd"):
        return {}
    coloc = [s for run in runs["colocated"] for s in run["samples"]]
    epd = [s for run in runs["epd"] for s in run["samples"]]
    pairs = list(zip(coloc, epd, strict=True))  # the same bodies in the same order
    differ = [{"round": c["round"], "n": c["n"], "case": c["case"]} for c, e in pairs if c["text"] != e["text"]]
    return {"compared": len(pairs), "differ": differ}


def goals(summary: dict) -> dict:
    """Each goal met or not: hit <= 0.5x miss per N (medians, and paired), one encode per unique image, wake p50 < 2 ms."""
    if "ratio_hit_vs_miss" not in summary:
        return {}
    wake = summary["wake_ms"]["all"] if summary["wake_ms"]["all"]["n"] else summary["wake_ms"]["upper_bound"]
    return {"hit_le_half_miss": {n: r <= HIT_GOAL for n, r in summary["ratio_hit_vs_miss"].items()},
            "hit_le_half_miss_paired": {n: r["median"] <= HIT_GOAL
                                        for n, r in summary["ratio_hit_vs_miss_paired"].items()},
            "one_encode_per_unique_image": summary["encoder_calls"]["overall_calls_per_unique_image"] == 1.0,
            "wake_p50_under_2ms": wake["n"] > 0 and wake["median"] < WAKE_GOAL_MS}
