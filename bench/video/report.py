"""What a run shows: the table, the plot and the summary's figures."""

from __future__ import annotations

from pathlib import Path

from bench.common.output import print_header, pyplot, save_figure
from bench.common.record import Figure
from bench.video.analysis import trial_figures
from bench.video.workload import LABELS


def _x(value, fmt: str = ".2f", suffix: str = "x") -> str:
    return "-" if value is None else f"{value:{fmt}}{suffix}"


def _hit_ratio(summary: dict, mode: str, case: str, f: str):
    """``mode``'s hit / its own miss for a hit ``case`` (None for a miss or where not measured)."""
    name = {"hit": "hit", "follow_up_hit": "follow_up_hit"}.get(case)
    return summary.get(f"ratio_{mode}_{name}_vs_miss", {}).get(f) if name else None


def print_table(summary: dict, frames: list[int]) -> None:
    ttft = summary["ttft_ms"]
    print_header(f"{'frames':>6}{'prompt':>8}  {'system':<10}{'case':<15}{'TTFT p50':>9}{'p90':>9}{'n':>4}"
                 f"{'cached':>7}{'prefix hit':>11}{'enc':>5}{'hit/miss':>10}{'paired':>8}{'/coloc':>8}")
    for f in map(str, frames):
        first = True
        for mode in ttft:
            for case, s in ttft[mode][f].items():
                if not s["n"]:
                    continue
                lead = f"{f:>6}{summary['prompt_tokens'].get(f) or 0:>8}" if first else " " * 14
                first = False
                hm = _hit_ratio(summary, mode, case, f)
                paired = summary.get(f"ratio_epd_{case}_vs_miss_paired", {}).get(f, {}).get("median") \
                    if mode == "epd" and case.endswith("hit") else None
                coloc = summary["ratio_epd_vs_colocated"][f].get(case) if mode == "epd" else None
                cached = summary["cached_tokens"][mode][f][case]
                usage = summary["usage_cached_tokens"][mode][f][case]
                enc = summary["videos_encoded"].get(mode, {}).get(f, {}).get(case)
                print(f"{lead}  {mode:<10}{case.replace('follow_up_', 'f-up '):<15}{s['median']:>9.1f}{s['p90']:>9.1f}"
                      f"{s['n']:>4}{'-' if usage is None else f'{usage:g}':>7}{'-' if cached is None else f'{cached:g}':>11}"
                      f"{'-' if enc is None else f'{enc:g}':>5}{_x(hm) if hm is not None else '':>10}"
                      f"{_x(paired) if paired is not None else '':>8}{_x(coloc):>8}")
    print("TTFT in ms through the router: send -> first SSE chunk with content. miss: a video no stack has seen;")
    print("hit (embedding cache only): the same bytes again with a different question written BEFORE the video,")
    print("so the prefix cache reuses only the chat template's head: in epd only the embedding cache hits;")
    print("colocated has no embedding cache (its hit is recomputed). f-up (follow-up): the video first, then the")
    print("question; its miss a new video, its hit the same video with another question: the prefix cache covers")
    print("the video's span too (embedding + prefix cache). cached: the answer's usage cached_tokens; prefix hit:")
    print("the KV server's prefix-cache hit tokens; enc: videos the encoder ran (medians / means). hit/miss: each")
    print("kind's hit over its own miss (goal <= 0.3; judged on the embedding-cache-only hit).")
    e = summary.get("encoder")
    if e:
        print_header(f"encoder, {e['frames_per_video']} frames per video: {'part':<10}{'videos':>7}{'frames/s':>10}"
                     f"{'per answer':>11}{'answer s':>9}{'tower f/s':>10}{'decode f/s':>11}")
        for name, p in e["parts"].items():
            print(f"{'':<38}{name:<10}{p['videos']:>7}{_x(p['fps_wall_median'], '.1f', ''):>10}"
                  f"{_x(p['fps_per_answer_median'], '.1f', ''):>11}{p['answer_seconds_median']:>9.3f}"
                  f"{_x(p.get('tower_fps'), '.1f', ''):>10}{_x(p.get('decode_fps'), '.1f', ''):>11}")
        print(f"frames/s: sampled frames of a round / its wall time (median over rounds); batched / batch 1: "
              f"{_x(e.get('ratio_batched_vs_1'))}. per answer: frames / the answer's seconds (arrival -> cached).")
        print("tower f/s, decode f/s: frames over the encoder's own seconds (epd_encoder_seconds, video_decode_seconds).")
    t = summary["tpot"]
    if t:
        print_header(f"{'system':<10}{'stream':<16}{'TPOT p99':>9}{'p50':>8}{'ITL p99':>9}{'max':>8}{'in window':>10}"
                     f"{'video TTFT':>11}{'TPOT x':>8}{'ITL x':>7}{'cpu s':>7}{'+cpu s':>7}")
        for mode, entry in t.items():
            rows = [("alone", entry["alone"], None)] + [(f"with {fr} frames", b["with_video"], b)
                                                       for fr, b in entry.get("by_frames", {}).items()]
            for label, s, b in rows:
                vt = s.get("video_ttft_ms", {}).get("median") if b else None
                print(f"{mode:<10}{label:<16}{_x(s['tpot_p99_ms'], '.1f', ''):>9}{_x(s['tpot_median_ms'], '.1f', ''):>8}"
                      f"{_x(s['itl_p99_ms'], '.1f', ''):>9}{_x(s['itl_max_ms'], '.0f', ''):>8}"
                      f"{_x(s.get('window_tpot_ms'), '.1f', ''):>10}{_x(vt, '.0f', ''):>11}"
                      f"{_x(b['ratio_tpot_p99']) if b else '':>8}{_x(b['ratio_itl_p99']) if b else '':>7}"
                      f"{_x(s.get('stream_server_cpu_s_median'), '.2f', ''):>7}"
                      f"{_x(b['extra_stream_server_cpu_s'], '.2f', '') if b else '':>7}")
        print("ms. One long text stream (ignore_eos); 'with N frames': a new video request sent once it has its first")
        print("tokens. TPOT: (last token - first) / (tokens - 1) per stream, p99 over trials (nearest rank); ITL: its")
        print("token gaps pooled; 'in window': the mean gap while the video was in flight (sent -> its first token).")
        print("cpu s: CPU seconds of the server decoding the stream (epd: the decode) over a trial, median; +cpu s:")
        print("with the video minus alone (epd: the KV written into the decode's process, its 8 tokens).")
    for where, error in summary.get("errors", {}).items():
        print(f"not measured: {where}: {error}")


def plot(summary: dict, runs: dict, frames: list[int], path: Path, title: str) -> None:
    """TTFT bars per frame count (system x case), encoder frames/s (batch 1 vs batched), the stream's
    token gaps over time with a video beside it (one trial per system)."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.4), gridspec_kw={"width_ratios": [2, 1, 2.2]})
    ax = axes[0]
    colours = {("colocated", "miss"): "grey", ("colocated", "hit"): "silver", ("colocated", "follow_up_miss"): "dimgrey",
               ("colocated", "follow_up_hit"): "gainsboro", ("epd", "miss"): "tab:red", ("epd", "hit"): "tab:green",
               ("epd", "follow_up_miss"): "tab:orange", ("epd", "follow_up_hit"): "tab:blue"}
    bars = [(m, c, col) for (m, c), col in colours.items()
            if c in summary["ttft_ms"].get(m, {}).get(str(frames[0]), {})]
    width = 0.8 / max(1, len(bars))
    for j, (mode, case, colour) in enumerate(bars):
        for i, f in enumerate(map(str, frames)):
            s = summary["ttft_ms"][mode][f][case]
            if not s["n"]:
                continue
            x = i + (j - (len(bars) - 1) / 2) * width
            ax.bar(x, s["median"], width, yerr=[[0], [s["p90"] - s["median"]]], capsize=2, color=colour,
                   label=f"{mode} {case.replace('_', '-')}" if i == 0 else None)
            label = f"{s['median']:.0f}"
            hm = _hit_ratio(summary, mode, case, f) if mode == "epd" else None
            if hm is not None:
                label += f"\n{hm:.2f}x"
            ax.text(x, s["median"], label, ha="center", va="bottom", fontsize=6)
    ax.set_xticks(range(len(frames)), [f"{f} frames\n({summary['prompt_tokens'].get(str(f))} tok)" for f in frames],
                  fontsize=8)
    ax.set_ylabel("TTFT ms (median, bar to p90)")
    ax.set_title("1-video chat: miss vs hit, embedding-only and follow-up (label: epd hit/its miss)", fontsize=8)
    ax.legend(fontsize=7)
    ax.grid(axis="y", alpha=0.3)
    ax = axes[1]
    e = summary.get("encoder")
    if e:
        names = list(e["parts"])
        values = [e["parts"][n]["fps_wall_median"] or 0 for n in names]
        ax.bar(range(len(names)), values, 0.6, color="tab:purple")
        for i, v in enumerate(values):
            ax.text(i, v, f"{v:.0f}", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(names)), [n.replace("_", " ") for n in names], fontsize=8)
        ax.set_ylabel("sampled frames / s")
    ax.set_title(f"encoder frames/s ({e['frames_per_video']} frames a video)" if e else "encoder: not measured",
                 fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    ax = axes[2]
    for mode, colour in (("colocated", "grey"), ("epd", "tab:red")):
        trials = runs.get(mode, {}).get("tpot")
        if not isinstance(trials, list):
            continue
        for with_video, style in ((False, ":"), (True, "-")):
            trial = next((t for t in trials if t["with_video"] is with_video), None)
            if trial is None or len(trial["token_s"]) < 2:
                continue
            gaps = trial_figures(trial)["gaps_ms"]
            ax.plot(trial["token_s"][1:], gaps, style, color=colour, linewidth=1,
                    label=f"{mode}, {'video beside it' if with_video else 'alone'}")
            if with_video and trial.get("video") and "ttft_s" in trial["video"]:
                ax.axvspan(trial["video"]["sent_s"], trial["video"]["ttft_s"], color=colour, alpha=0.12)
    ax.set_yscale("log")
    ax.set_xlabel("s since the stream was sent (shaded: the video in flight, sent -> first token)")
    ax.set_ylabel("gap before each token (ms)")
    ax.set_title("long stream's token gaps, first trial", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=9)
    save_figure(fig, path)


def figures(summary: dict, frames: list[int]) -> list[Figure]:
    """TTFT medians per case and the hit / miss ratios per kind, epd / colocated, the answers' cached
    tokens and the encoder's videos per epd request, encoder frames/s, the stream's TPOT p99 and its
    ratios (the headline video and each other frame count), the extra CPU of the decode."""
    out = []
    for f in map(str, frames):
        for mode in summary["ttft_ms"]:
            for case in summary["ttft_ms"][mode][f]:
                out.append(Figure(f"{f} frames: TTFT p50, {mode} {LABELS[case]}",
                                  summary["ttft_ms"][mode][f][case].get("median"), "ms"))
        if "epd" in summary["ttft_ms"]:
            out.append(Figure(f"{f} frames: TTFT epd hit (embedding cache only) / epd miss (goal <= 0.3, judged)",
                              summary["ratio_epd_hit_vs_miss"][f], "x"))
            if "follow_up_hit" in summary["ttft_ms"]["epd"][f]:
                out.append(Figure(f"{f} frames: TTFT epd follow-up hit (embedding + prefix cache) / its miss "
                                  "(goal <= 0.3)", summary["ratio_epd_follow_up_hit_vs_miss"][f], "x"))
            if "colocated" in summary["ttft_ms"]:
                out += [Figure(f"{f} frames: TTFT epd / colocated, {LABELS[c]}", summary["ratio_epd_vs_colocated"][f][c],
                               "x") for c in ("miss", "hit", "follow_up_hit") if c in summary["ttft_ms"]["epd"][f]]
            for case in summary["ttft_ms"]["epd"][f]:
                out.append(Figure(f"{f} frames: cached tokens (usage), epd {LABELS[case]}",
                                  summary["usage_cached_tokens"]["epd"][f][case], "tokens"))
            for case in ("hit", "follow_up_hit"):
                encoded = summary["videos_encoded"].get("epd", {}).get(f, {})
                if case in encoded:
                    out.append(Figure(f"{f} frames: videos encoded per request, epd {LABELS[case]}", encoded[case],
                                      "videos"))
    e = summary.get("encoder")
    if e:
        for name, p in e["parts"].items():
            out.append(Figure(f"encoder frames/s, {name.replace('_', ' ')} ({e['frames_per_video']} frames a video)",
                              p["fps_wall_median"], "frames/s"))
        out.append(Figure("encoder frames/s batched / batch 1", e.get("ratio_batched_vs_1"), "x"))
    for mode, entry in summary["tpot"].items():
        head = entry.get("video_frames")
        out += [Figure(f"{mode}: stream TPOT p99, alone", entry["alone"]["tpot_p99_ms"], "ms"),
                Figure(f"{mode}: stream TPOT p99, video beside it", entry["with_video"]["tpot_p99_ms"], "ms"),
                Figure(f"{mode}: stream TPOT p99 with video / alone" + (" (goal <= 1.2)" if mode == "epd" else ""),
                       entry["ratio_tpot_p99"], "x"),
                Figure(f"{mode}: stream ITL p99 with video / alone", entry["ratio_itl_p99"], "x")]
        for fr, b in entry.get("by_frames", {}).items():
            if fr != str(head):
                out.append(Figure(f"{mode}: stream TPOT p99 with a {fr}-frame video / alone", b["ratio_tpot_p99"], "x"))
        if mode == "epd":
            for fr, b in entry.get("by_frames", {}).items():
                out.append(Figure(f"epd: decode CPU s per stream, with a {fr}-frame video - alone",
                                  b["extra_stream_server_cpu_s"], "s"))
    return out


def notes(summary: dict, args) -> list[str]:
    """The summary's notes: the pinning, which hit the goal is judged on, and the TPOT result's explanation
    with this run's own numbers."""
    out = [f"Pinning: decode alone on core(s) {args.decode_cores}; encoder {args.encoder_cores}, prefill "
           f"{args.prefill_cores}, colocated server {args.colocated_cores}; router, Redis and the client unpinned "
           f"(they share the cores, the decode's included); {args.threads} torch thread(s) a server.",
           "The issue's hit goal (epd hit <= 0.3x miss, 'cache miss and hit') is judged on the embedding-cache-only "
           "hit: the same video with a different question before it, so only the embedding cache can hit (usage "
           "cached_tokens = the template's head) and the video's placeholder tokens are prefilled again. The "
           "follow-up hit (the video first, another question after it) is what a multi-turn chat gets: the prefix "
           "cache covers the video's span as well, so the prefill is left with the question only."]
    t = summary["tpot"].get("epd")
    if t and t.get("by_frames"):
        parts = []
        for fr, b in t["by_frames"].items():
            w = b["with_video"]
            parts.append(f"{fr} frames ({w.get('video_prompt_tokens')} prompt tokens): TPOT p99 {_x(b['ratio_tpot_p99'])}, "
                         f"mean gap in flight {_x(b['ratio_window_tpot_vs_alone_median'])} the alone TPOT; the stream "
                         f"took {_x(b.get('extra_stream_s'), '.2f', ' s')} longer (median), the decode's own CPU "
                         f"{_x(b['extra_stream_server_cpu_s'], '.2f', ' s')} more than alone")
        out.append("epd TPOT p99 beside a video: " + "; ".join(parts) + ". The decode runs alone on its core, but "
                   "the video's prompt KV is written into the decode's process over TCP on this machine (no RDMA), "
                   "and the router, Redis and the client (unpinned) run on its core too while the video is in "
                   "flight. The decode's own extra CPU is its part of the stall (receiving the KV, the video "
                   "request's tokens); the rest of the added time is the core taken by the others. The frame counts "
                   "show how the stall scales with the KV moved; on a GPU with RDMA the KV write would not use "
                   "the decode's CPU.")
    return out
