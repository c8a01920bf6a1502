"""The numbers of a run from its samples: per system and image count the TTFT medians, the ratios and
their goals, the prefill's overlap figures and the encoder's time from the room timelines, and the
same-text check. Pure; tested in tests/bench/test_prefill_overlap.py."""

from __future__ import annotations

import statistics

from bench.common.stats import describe, ratio

GOALS = {"overlap / no_overlap": 0.75, "overlap / colocated": 1.0}  # TTFT medians, at most


def prefill_figures(events: list[dict] | None) -> dict[str, float | None]:
    """From a prefill's room events: ``embeddings_ready``'s ``overlap_s`` (ms) and ``computed_tokens``
    (None where absent: without overlap they are not marked); ``wait_ms``, queued -> embeddings_ready
    without overlap (the request waits out of the engine; with overlap: None); ``forward_ms``, from
    when the request entered the engine (queued with overlap: a prefill's forward pass starts on its
    HTTP half's arrival; embeddings_ready without) to prefilled."""
    by_name = {e["event"]: e for e in events or []}
    ready = by_name.get("embeddings_ready", {})
    overlapped = "overlap_s" in ready
    out: dict[str, float | None] = {"overlap_ms": round(1e3 * ready["overlap_s"], 3) if overlapped else None,
                                    "computed_tokens": ready.get("computed_tokens"), "wait_ms": None,
                                    "forward_ms": None}
    if "queued" in by_name and ready and not overlapped:
        out["wait_ms"] = round(1e3 * (ready["t"] - by_name["queued"]["t"]), 3)
    entered = by_name.get("queued") if overlapped or not ready else ready
    if entered is not None and "prefilled" in by_name:
        out["forward_ms"] = round(1e3 * (by_name["prefilled"]["t"] - entered["t"]), 3)
    return out


def encode_ms(events: list[dict] | None) -> float | None:
    """The encoder's time for a room: its ``queued`` to its last ``encoded`` (ms); None without both."""
    queued = [e["t"] for e in events or [] if e["event"] == "queued"]
    encoded = [e["t"] for e in events or [] if e["event"] == "encoded"]
    return round(1e3 * (max(encoded) - min(queued)), 3) if queued and encoded else None


def _median(values: list) -> float | None:
    present = [v for v in values if v is not None]
    return round(statistics.median(present), 3) if present else None


def summarize(samples: list[dict], n: int) -> dict:
    """The timed samples of ``n`` images: TTFT (ms) described, prompt and cached tokens, and for EPD
    the medians of the prefill's overlap figures and the encoder's time."""
    timed = [s for s in samples if s["n"] == n and not s["warmup"]]
    out: dict = {"ttft_ms": describe([1e3 * s["ttft_s"] for s in timed]),
                 "prompt_tokens": timed[0]["prompt_tokens"] if timed else None,
                 "cached_tokens_median": _median([s.get("cached_tokens") for s in timed])}
    if timed and "prefill_events" in timed[0]:
        rows = [prefill_figures(s["prefill_events"]) for s in timed]
        out.update({f"{k}_median": _median([r[k] for r in rows]) for k in rows[0]})
        out["encode_ms_median"] = _median([encode_ms(s.get("encoder_events")) for s in timed])
    return out


def summarize_all(samples: dict[str, list[dict]], counts: list[int]) -> dict:
    """Per system and N (as a string key) ``summarize``; the ratios of the TTFT medians per N and
    whether each meets its goal; whether overlap and no_overlap (and colocated) answered alike."""
    per = {system: {str(n): summarize(s, n) for n in counts} for system, s in samples.items()}
    ratios: dict[str, dict[str, float | None]] = {}
    for name in GOALS:
        top, bottom = name.split(" / ")
        if top in per and bottom in per:
            ratios[name] = {str(n): ratio(per[top][str(n)]["ttft_ms"].get("median"),
                                          per[bottom][str(n)]["ttft_ms"].get("median")) for n in counts}
    goals = {name: {n: (v is not None and v <= GOALS[name]) for n, v in by_n.items()} for name, by_n in ratios.items()}
    return {"systems": per, "ratios": ratios, "goals_met": goals, "same_text": same_text(samples)}


def same_text(samples: dict[str, list[dict]]) -> dict[str, bool | None]:
    """Per system other than overlap: whether it answered every timed request it shares with overlap (by
    number) with overlap's text; None where they share none."""
    base = {s["number"]: s["text"] for s in samples.get("overlap", []) if not s["warmup"]}
    out: dict[str, bool | None] = {}
    for system, rows in samples.items():
        if system == "overlap":
            continue
        mine = {s["number"]: s["text"] for s in rows if not s["warmup"]}
        shared = mine.keys() & base.keys()
        out[system] = all(mine[k] == base[k] for k in shared) if shared else None
    return out
