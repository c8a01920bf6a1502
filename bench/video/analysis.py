"""The numbers of a run from its samples: TTFT medians per system, frame count and case, the ratios
bench/README.md quotes (epd hit / miss, epd / colocated), the prefix cache's share of a hit, the
encoder's frames per second alone and batched, and the long stream's TPOT and token gaps with and
without a video beside it; the goals. Pure; tested in tests/bench/test_video.py."""

from __future__ import annotations

import statistics

from bench.common.stats import describe, percentile, ratio
from bench.video.workload import CASES, EMBEDDING, KINDS

ALL_CASES = tuple(c for kind in KINDS for c in CASES[kind])

HIT_GOAL = 0.3  # epd hit / epd miss
TPOT_GOAL = 1.2  # epd: TPOT p99 with a video beside the stream / alone


def _ok(part) -> list:
    """A part's samples, or [] for a part that failed (a dict with ``error``) or did not run."""
    return part if isinstance(part, list) else []


def ttft_summary(runs: dict[str, dict], frames: list[int]) -> dict:
    """Per system, frame count and case (``miss``, ``hit``: the embedding-cache-only pair;
    ``follow_up_miss``, ``follow_up_hit``: the video before the question): TTFT stats (ms), the answers'
    ``cached_tokens`` (usage: prompt tokens from the prefix cache) and the KV server's prefix-cache hit
    tokens (medians), and the videos the encoder ran (epd); per kind the ratios epd hit / its miss
    (medians and paired) and colocated hit / its miss; epd / colocated per case."""
    out: dict = {"ttft_ms": {}, "prompt_tokens": {}, "cached_tokens": {}, "usage_cached_tokens": {},
                 "videos_encoded": {}}
    for mode, run in runs.items():
        timed = [s for s in _ok(run.get("ttft")) if not s["warmup"]]
        for f in frames:
            for case in ALL_CASES:
                mine = [s for s in timed if s["frames"] == f and s["case"] == case]
                if not mine and case not in CASES[EMBEDDING]:
                    continue  # a run without follow-up pairs
                out["ttft_ms"].setdefault(mode, {}).setdefault(str(f), {})[case] = describe(
                    [1e3 * s["ttft_s"] for s in mine])
                for key, field in (("cached_tokens", "prefix_hit_tokens"), ("usage_cached_tokens", "cached_tokens")):
                    values = [s[field] for s in mine if s.get(field) is not None]
                    out[key].setdefault(mode, {}).setdefault(str(f), {})[case] = \
                        statistics.median(values) if values else None
                encoded = [s["videos_encoded"] for s in mine if s.get("videos_encoded") is not None]
                if encoded:
                    per_mode = out["videos_encoded"].setdefault(mode, {})
                    per_mode.setdefault(str(f), {})[case] = sum(encoded) / len(encoded)
            for kind in KINDS:
                prompt = [s["prompt_tokens"] for s in timed if s["frames"] == f and s["prompt_tokens"]
                          and s.get("kind", EMBEDDING) == kind]
                if prompt:
                    key = str(f) if kind == EMBEDDING else f"{f}_{kind}"
                    out["prompt_tokens"].setdefault(key, prompt[0])
            out["prompt_tokens"].setdefault(str(f), None)
    med = lambda mode, f, case: out["ttft_ms"].get(mode, {}).get(str(f), {}).get(case, {}).get("median")  # noqa: E731
    epd = [s for s in _ok(runs.get("epd", {}).get("ttft")) if not s["warmup"]]
    for kind, (miss, hit) in CASES.items():
        name = "hit" if kind == EMBEDDING else f"{kind}_hit"
        out[f"ratio_epd_{name}_vs_miss"] = {str(f): ratio(med("epd", f, hit), med("epd", f, miss)) for f in frames}
        out[f"ratio_colocated_{name}_vs_miss"] = {str(f): ratio(med("colocated", f, hit), med("colocated", f, miss))
                                                  for f in frames}
        misses = {(s["frames"], s["index"]): s["ttft_s"] for s in epd if s["case"] == miss}
        out[f"ratio_epd_{name}_vs_miss_paired"] = {
            str(f): describe([s["ttft_s"] / misses[(f, s["index"])] for s in epd
                              if s["frames"] == f and s["case"] == hit and (f, s["index"]) in misses])
            for f in frames}
    out["ratio_epd_vs_colocated"] = {str(f): {c: ratio(med("epd", f, c), med("colocated", f, c))
                                              for c in ALL_CASES} for f in frames}
    return out


def encoder_summary(encoder) -> dict | None:
    """Frames per second of the encoder per part: from the answers' ``seconds`` (batch 1: frames / each
    answer's seconds, median) and from the client's wall time per round (frames of the round / its wall,
    median); batched / batch 1 of the wall figure; the tower's mean batch size and decode seconds where
    the encoder's metrics moved."""
    if not isinstance(encoder, dict) or "parts" not in encoder:
        return None
    frames = encoder["frames_per_video"]
    out = {"frames_per_video": frames, "parts": {}}
    for name, part in encoder["parts"].items():
        rounds = part["rounds"]
        per_answer = [frames / a["seconds"] for r in rounds for a in r["answers"] if a["seconds"]]
        per_round = [frames * len(r["answers"]) / r["wall_s"] for r in rounds]
        m = part["metrics"]
        entry = {"batch": part["batch"], "videos": sum(len(r["answers"]) for r in rounds),
                 "statuses": sorted({a["status"] for r in rounds for a in r["answers"]}),
                 "fps_wall_median": round(statistics.median(per_round), 2) if per_round else None,
                 "fps_per_answer_median": round(statistics.median(per_answer), 2) if per_answer else None,
                 "answer_seconds_median": statistics.median(a["seconds"] for r in rounds for a in r["answers"]),
                 "wall_s_median": statistics.median(r["wall_s"] for r in rounds)}
        if m.get("epd_encoder_batch_size_count"):  # image calls only: a video is its own call
            entry["tower_batch_mean"] = round(m["epd_encoder_batch_size_sum"] / m["epd_encoder_batch_size_count"], 2)
        entry["tower_fps"] = ratio(m.get("epd_encoder_video_frames_encoded_total"), m.get("epd_encoder_seconds_sum"), 1)
        entry["decode_fps"] = ratio(m.get("epd_encoder_video_frames_decoded_total"),
                                    m.get("epd_encoder_video_decode_seconds_sum"), 1)
        out["parts"][name] = entry
    names = list(out["parts"])
    if len(names) == 2:
        out["ratio_batched_vs_1"] = ratio(out["parts"][names[1]]["fps_wall_median"],
                                          out["parts"][names[0]]["fps_wall_median"])
    return out


def trial_figures(trial: dict) -> dict:
    """One stream's TPOT (first token -> last / (tokens - 1), ms), its gaps (ms), and with a video: the
    gaps while the video was in flight (its send -> its first token) and their mean."""
    times = trial["token_s"]
    gaps = [1e3 * (b - a) for a, b in zip(times, times[1:])]
    out = {"tokens": len(times), "tpot_ms": round(1e3 * (times[-1] - times[0]) / (len(times) - 1), 3)
           if len(times) > 1 else None, "gaps_ms": gaps}
    video = trial.get("video")
    if video and "ttft_s" in video:
        window = [1e3 * (b - a) for a, b in zip(times, times[1:]) if b > video["sent_s"] and a < video["ttft_s"]]
        out["window_gaps_ms"] = window
        out["window_tpot_ms"] = round(statistics.mean(window), 3) if window else None
        out["video_ttft_ms"] = round(1e3 * (video["ttft_s"] - video["sent_s"]), 1)
    return out


def _stream_figures(trials: list[dict]) -> dict:
    """TPOT per stream (p99 = nearest rank over trials, median), the gaps pooled (p50, p99, max), the
    CPU seconds of the server decoding the stream over each trial (median); with a video: the gaps
    while it was in flight, its TTFT and prompt tokens."""
    figs = [trial_figures(t) for t in trials]
    tpots = [f["tpot_ms"] for f in figs if f["tpot_ms"] is not None]
    gaps = [g for f in figs for g in f["gaps_ms"]]
    cpu = [t["stream_server_cpu_s"] for t in trials if t.get("stream_server_cpu_s") is not None]
    e = {"trials": len(figs), "tpot_p99_ms": round(percentile(tpots, 0.99), 3) if tpots else None,
         "tpot_median_ms": round(statistics.median(tpots), 3) if tpots else None,
         "itl_p50_ms": round(percentile(gaps, 0.5), 3) if gaps else None,
         "itl_p99_ms": round(percentile(gaps, 0.99), 3) if gaps else None,
         "itl_max_ms": round(max(gaps), 3) if gaps else None,
         "stream_server_cpu_s_median": round(statistics.median(cpu), 3) if cpu else None}
    if any(t["with_video"] for t in trials):
        window = [g for f in figs for g in f.get("window_gaps_ms", [])]
        e["window_tpot_ms"] = round(statistics.mean(window), 3) if window else None
        e["window_gaps"] = len(window)
        e["video_ttft_ms"] = describe([f["video_ttft_ms"] for f in figs if "video_ttft_ms" in f])
        prompt = [t["video"]["prompt_tokens"] for t in trials if (t.get("video") or {}).get("prompt_tokens")]
        e["video_prompt_tokens"] = prompt[0] if prompt else None
    return e


def tpot_summary(runs: dict[str, dict]) -> dict:
    """Per system: the stream alone and with a video beside it (``with_video``: the first frame count of
    the trials, the headline; ``by_frames``: every frame count), each as ``_stream_figures``; the ratios
    with / alone (TPOT p99, ITL p99, the in-flight mean gap over the median TPOT alone) and the extra CPU
    seconds the video cost the server decoding the stream (median with - median alone)."""
    out = {}
    for mode, run in runs.items():
        trials = _ok(run.get("tpot"))
        if not trials:
            continue
        alone = _stream_figures([t for t in trials if not t["with_video"]])
        order = list(dict.fromkeys(t.get("video_frames") for t in trials if t["with_video"]))
        by_frames = {}
        for frames in order:
            w = _stream_figures([t for t in trials if t["with_video"] and t.get("video_frames") == frames])
            extra = None
            if w["stream_server_cpu_s_median"] is not None and alone["stream_server_cpu_s_median"] is not None:
                extra = round(w["stream_server_cpu_s_median"] - alone["stream_server_cpu_s_median"], 3)
            added = None  # the stream's time the video added: the median TPOT's growth over the stream's gaps
            if w["tpot_median_ms"] is not None and alone["tpot_median_ms"] is not None:
                gaps = statistics.median(len(t["token_s"]) - 1 for t in trials if not t["with_video"])
                added = round((w["tpot_median_ms"] - alone["tpot_median_ms"]) * gaps / 1e3, 3)
            by_frames[str(frames)] = {"with_video": w, "extra_stream_s": added, "ratio_tpot_p99": ratio(w["tpot_p99_ms"], alone["tpot_p99_ms"]),
                                      "ratio_itl_p99": ratio(w["itl_p99_ms"], alone["itl_p99_ms"]),
                                      "ratio_window_tpot_vs_alone_median": ratio(w.get("window_tpot_ms"),
                                                                                 alone["tpot_median_ms"]),
                                      "extra_stream_server_cpu_s": extra}
        head = by_frames[str(order[0])] if order else {"with_video": _stream_figures([])}
        out[mode] = {"alone": alone, "video_frames": order[0] if order else None, "with_video": head["with_video"],
                     **{k: head.get(k) for k in ("ratio_tpot_p99", "ratio_itl_p99",
                                                 "ratio_window_tpot_vs_alone_median", "extra_stream_server_cpu_s")},
                     "by_frames": by_frames}
    return out


def summarize(runs: dict[str, dict], frames: list[int]) -> dict:
    return {**ttft_summary(runs, frames), "encoder": encoder_summary(runs.get("epd", {}).get("encoder")),
            "tpot": tpot_summary(runs),
            "errors": {f"{mode}.{part}": run[part]["error"] for mode, run in runs.items()
                       for part in ("ttft", "encoder", "tpot")
                       if isinstance(run.get(part), dict) and "error" in run[part]}}


def goals(summary: dict) -> dict:
    """Per frame count: epd hit (embedding cache only) <= 0.3x its miss (the issue's goal, judged on it)
    and the follow-up hit (embedding + prefix cache) <= 0.3x its miss (reported); epd TPOT p99 with a
    video beside the stream (the headline frame count) <= 1.2x alone. None: not measured."""
    le = lambda r, goal: None if r is None else r <= goal  # noqa: E731
    out = {"epd_hit_le_0.3x_miss": {f: le(r, HIT_GOAL) for f, r in summary["ratio_epd_hit_vs_miss"].items()}}
    if "ratio_epd_follow_up_hit_vs_miss" in summary:
        out["epd_follow_up_hit_le_0.3x_miss"] = {f: le(r, HIT_GOAL)
                                                 for f, r in summary["ratio_epd_follow_up_hit_vs_miss"].items()}
    out["epd_tpot_p99_with_video_le_1.2x"] = le(summary["tpot"].get("epd", {}).get("ratio_tpot_p99"), TPOT_GOAL)
    return out
