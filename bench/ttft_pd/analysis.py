"""The numbers of a run from its samples: per workload TTFT medians, p90, min and the KV write,
rounds pooled per system, PD / colocated, the same-text check, and where a PD request's TTFT went
(``breakdown``: the phases between the room-timeline events of its prefill and its decode). Pure;
tested in tests/bench/test_ttft_pd.py."""

from __future__ import annotations

import statistics

from bench.common.stats import percentile

# A PD request's TTFT, phase by phase (ms): the chain from the client's send to its first content, each
# phase from one timeline event to the next (wall clocks of one machine); they add up to the TTFT. The
# prefill's forward pass starts when its own request arrives (``queued``), beside the handshake; the
# handshake is on the chain only where the pairing came after the forward pass (``pair_wait``).
CHAIN = (
    ("arrival_p", "client send -> P queued"),
    ("p_compute", "P queued -> prefilled (P forward; embeddings wait taken out)"),
    ("pair_wait", "prefilled -> paired, where the decode's KV request came after the forward (else 0)"),
    ("kv_write", "prefilled and paired -> kv_written"),
    ("ready_send", "kv_written -> ready_sent"),
    ("ready_to_d", "ready_sent -> D kv_ready"),
    ("d_first_step", "D kv_ready -> first_token"),
    ("to_client", "D first_token -> client first content"),
)
# Beside the chain: the handshake (both sides), and an EPD prefill's wait for its embeddings.
SIDE = (
    ("handshake", "P queued -> paired (the decode's KV request came; overlaps p_compute)"),
    ("arrival_d", "client send -> D queued"),
    ("d_reserve", "D queued -> blocks_reserved"),
    ("embeddings_wait", "P queued -> embeddings_ready (without overlap)"),
)
PHASES = tuple(name for name, _ in CHAIN + SIDE)


def first_times(events: list[dict] | None) -> dict[str, float]:
    """Each event's first wall-clock time ``t`` in a room's timeline ({} for None)."""
    out: dict[str, float] = {}
    for event in events or []:
        out.setdefault(event["event"], event["t"])
    return out


def breakdown(sample: dict) -> dict[str, float] | None:
    """A PD sample's TTFT by phase (``CHAIN`` and ``SIDE``, ms, 3 decimals) and ``unaccounted`` (TTFT -
    the chain's sum: ~0 when every event was found): from its ``sent_t`` (wall clock of the send),
    ``ttft_s`` and both servers' events. None for a sample without timelines (colocated) or one
    missing an event of the chain. The embeddings wait (an EPD prefill without overlap, whose
    ``embeddings_ready`` has no ``overlap_s``) is taken out of ``p_compute``; with overlap the two run
    together and ``p_compute`` holds both."""
    if "sent_t" not in sample:
        return None
    p, d = first_times(sample.get("prefill_events")), first_times(sample.get("decode_events"))
    first_content = sample["sent_t"] + sample["ttft_s"]
    if not {"queued", "paired", "prefilled", "kv_written", "ready_sent"} <= p.keys() \
            or not {"kv_ready", "first_token"} <= d.keys():
        return None
    marks = [sample["sent_t"], p["queued"], p["prefilled"], max(p["prefilled"], p["paired"]), p["kv_written"],
             p["ready_sent"], d["kv_ready"], d["first_token"], first_content]
    out = {name: 1e3 * (b - a) for (name, _), a, b in zip(CHAIN, marks, marks[1:])}
    ready = next((e for e in sample.get("prefill_events") or [] if e["event"] == "embeddings_ready"), None)
    wait = 1e3 * (ready["t"] - p["queued"]) if ready is not None and "overlap_s" not in ready else 0.0
    out["p_compute"] -= wait
    out["embeddings_wait"] = wait
    out["handshake"] = 1e3 * (p["paired"] - p["queued"])
    out["arrival_d"] = 1e3 * (d["queued"] - sample["sent_t"]) if "queued" in d else float("nan")
    out["d_reserve"] = 1e3 * (d["blocks_reserved"] - d["queued"]) if {"queued", "blocks_reserved"} <= d.keys() \
        else float("nan")
    out["unaccounted"] = 1e3 * sample["ttft_s"] - sum(out[name] for name, _ in CHAIN) - wait
    return {k: round(v, 3) for k, v in out.items()}


def median_breakdown(samples: list[dict]) -> dict | None:
    """Per phase the median over the samples that have a breakdown (NaN phases left out), and how
    many had one; None when none had."""
    rows = [b for b in (breakdown(s) for s in samples) if b is not None]
    if not rows:
        return None
    out: dict = {"n": len(rows)}
    for name in (*PHASES, "unaccounted"):
        values = [r[name] for r in rows if r[name] == r[name]]
        out[name] = round(statistics.median(values), 3) if values else None
    return out


def summarize(samples: list[dict]) -> dict:
    """One workload's timed samples (warm-up left out): TTFT median/p90/min and all, first chunk, total,
    tokens (the prompt's cached ones too: 0 for a miss), each server's CPU median; for PD the KV
    write's median time, bytes and GB/s and the TTFT's breakdown medians."""
    timed = [s for s in samples if not s.get("warmup")]
    ttft = [s["ttft_s"] for s in timed]
    cached = [s["cached_tokens"] for s in timed if s.get("cached_tokens") is not None]
    out = {"n": len(timed), "ttft_ms_median": round(1e3 * statistics.median(ttft), 2),
           "ttft_ms_p90": round(1e3 * percentile(ttft, 0.9), 2), "ttft_ms_min": round(1e3 * min(ttft), 2),
           "first_chunk_ms_median": round(1e3 * statistics.median(s["first_chunk_s"] for s in timed), 2),
           "total_ms_median": round(1e3 * statistics.median(s["total_s"] for s in timed), 2),
           "prompt_tokens": timed[0]["prompt_tokens"], "completion_tokens": timed[0]["completion_tokens"],
           "cached_tokens_median": statistics.median(cached) if cached else None,
           "ttft_ms_all": [round(1e3 * t, 2) for t in ttft], "warmup_ttft_ms": round(1e3 * samples[0]["ttft_s"], 2)}
    # CPU seconds each server spent on the request (its whole duration, /server_info and /rooms calls
    # included for PD) and the share of its core it got while the request ran (< 1: it waited for the core, or was idle)
    out["server_cpu_s_median"] = {r: round(statistics.median(s["server_cpu_s"][r] for s in timed), 3)
                                  for r in timed[0]["server_cpu_s"]}
    if "kv_write_s" in timed[0]:
        out["kv_write_ms_median"] = round(1e3 * statistics.median(s["kv_write_s"] for s in timed), 3)
        out["kv_bytes"] = timed[0]["kv_bytes"]
        out["kv_gbps_median"] = round(out["kv_bytes"] / (out["kv_write_ms_median"] / 1e3) / 1e9, 3) \
            if out["kv_write_ms_median"] else None
        out["prefill_reply_ms_median"] = round(1e3 * statistics.median(s["prefill_reply_s"] for s in timed), 2)
        out["breakdown_ms_median"] = median_breakdown(timed)
    return out


def merge_runs(name: str, runs: list[dict], workloads: list[str]) -> dict:
    """One system's result over all its rounds: samples pooled, each round's conditions kept, the
    timed replies' texts by request ``number`` (the same prompts in every system)."""
    pooled = {w: [s for run in runs for s in run["samples"][w]] for w in workloads}
    texts = {w: {str(s["number"]): s["text"] for s in pooled[w] if not s.get("warmup")} for w in workloads}
    return {"phase": name, "workloads": {w: summarize(pooled[w]) for w in workloads}, "texts": texts,
            "runs": [{k: v for k, v in run.items() if k != "samples"} for run in runs]}


def cache_problems(phases: list[dict], workloads: list[str], cache: dict[str, str]) -> list[str]:
    """What contradicts a workload's label: a miss whose timed requests got prompt tokens from the
    prefix cache, or a hit that got none; [] when each measured what it says."""
    out = []
    for phase in phases:
        for w in workloads:
            cached = phase["workloads"][w].get("cached_tokens_median")
            if cache[w] == "miss" and cached:
                out.append(f"{phase['phase']} {w}: a miss workload, but {cached:g} prompt tokens came from the cache")
            if cache[w] == "hit" and cached == 0:
                out.append(f"{phase['phase']} {w}: a hit workload, but no prompt token came from the cache")
    return out


def same_texts(phase: dict, base: dict, workload: str) -> bool:
    """Whether ``phase`` answered every request of ``workload`` it shares with ``base`` (by number)
    with the same text (greedy: expected), and they share at least one."""
    mine, theirs = phase["texts"][workload], base["texts"][workload]
    shared = mine.keys() & theirs.keys()
    return bool(shared) and all(mine[k] == theirs[k] for k in shared)


def ratios_vs_colocated(phases: list[dict], workloads: list[str]) -> dict[str, dict[str, float]]:
    """Per PD phase and workload: its TTFT median / the colocated phase's (the ratio bench/README.md
    quotes); {} without a colocated phase."""
    base = next((p for p in phases if p["phase"] == "colocated"), None)
    if base is None:
        return {}
    return {p["phase"]: {w: round(p["workloads"][w]["ttft_ms_median"] / base["workloads"][w]["ttft_ms_median"], 3)
                         for w in workloads} for p in phases if p is not base}
