"""The numbers of a run from its samples: per workload TTFT medians, p90, min and the KV write,
rounds pooled per system, and PD / colocated. Pure; tested in tests/bench/test_ttft_pd.py."""

from __future__ import annotations

import statistics

from bench.common.stats import percentile


def summarize(samples: list[dict]) -> dict:
    """One workload's timed samples (warm-up left out): TTFT median/p90/min and all, first chunk, total,
    tokens, each server's CPU median; for PD the KV write's median time, bytes and GB/s."""
    timed = [s for s in samples if not s.get("warmup")]
    ttft = [s["ttft_s"] for s in timed]
    out = {"n": len(timed), "ttft_ms_median": round(1e3 * statistics.median(ttft), 2),
           "ttft_ms_p90": round(1e3 * percentile(ttft, 0.9), 2), "ttft_ms_min": round(1e3 * min(ttft), 2),
           "first_chunk_ms_median": round(1e3 * statistics.median(s["first_chunk_s"] for s in timed), 2),
           "total_ms_median": round(1e3 * statistics.median(s["total_s"] for s in timed), 2),
           "prompt_tokens": timed[0]["prompt_tokens"], "completion_tokens": timed[0]["completion_tokens"],
           "ttft_ms_all": [round(1e3 * t, 2) for t in ttft], "warmup_ttft_ms": round(1e3 * samples[0]["ttft_s"], 2)}
    # CPU seconds each server spent on the request (its whole duration, /server_info calls included for PD)
    # and the share of its core it got while the request ran (< 1: it waited for the core, or was idle)
    out["server_cpu_s_median"] = {r: round(statistics.median(s["server_cpu_s"][r] for s in timed), 3)
                                  for r in timed[0]["server_cpu_s"]}
    if "kv_write_s" in timed[0]:
        out["kv_write_ms_median"] = round(1e3 * statistics.median(s["kv_write_s"] for s in timed), 3)
        out["kv_bytes"] = timed[0]["kv_bytes"]
        out["kv_gbps_median"] = round(out["kv_bytes"] / (out["kv_write_ms_median"] / 1e3) / 1e9, 3) \
            if out["kv_write_ms_median"] else None
        out["prefill_reply_ms_median"] = round(1e3 * statistics.median(s["prefill_reply_s"] for s in timed), 2)
    return out


def merge_runs(name: str, runs: list[dict], workloads: list[str]) -> dict:
    """One system's result over all its rounds: samples pooled, each round's conditions kept."""
    pooled = {w: [s for run in runs for s in run["samples"][w]] for w in workloads}
    texts = {w: [s["text"] for s in pooled[w] if not s.get("warmup")] for w in workloads}
    return {"phase": name, "workloads": {w: summarize(pooled[w]) for w in workloads},
            "texts": {w: texts[w][0] for w in workloads},
            "distinct_texts": {w: len(set(texts[w])) for w in workloads},
            "runs": [{k: v for k, v in run.items() if k != "samples"} for run in runs]}


def ratios_vs_colocated(phases: list[dict], workloads: list[str]) -> dict[str, dict[str, float]]:
    """Per PD phase and workload: its TTFT median / the colocated phase's (the ratio bench/README.md
    quotes); {} without a colocated phase."""
    base = next((p for p in phases if p["phase"] == "colocated"), None)
    if base is None:
        return {}
    return {p["phase"]: {w: round(p["workloads"][w]["ttft_ms_median"] / base["workloads"][w]["ttft_ms_median"], 3)
                         for w in workloads} for p in phases if p is not base}
