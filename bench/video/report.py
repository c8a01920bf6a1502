"""What a run shows: the table, the plot and the summary's figures."""

from __future__ import annotations

from pathlib import Path

from bench.common.output import print_header, pyplot, save_figure
from bench.common.record import Figure
from bench.video.analysis import trial_figures


def _x(value, fmt: str = ".2f", suffix: str = "x") -> str:
    return "-" if value is None else f"{value:{fmt}}{suffix}"


def print_table(summary: dict, frames: list[int]) -> None:
    ttft = summary["ttft_ms"]
    print_header(f"{'frames':>6}{'prompt':>8}  {'system':<10}{'case':<6}{'TTFT p50':>9}{'p90':>9}{'n':>4}"
                 f"{'prefix hit':>11}{'hit/miss':>10}{'paired':>8}{'/coloc':>8}")
    for f in map(str, frames):
        first = True
        for mode in ttft:
            for case in ("miss", "hit"):
                s = ttft[mode][f][case]
                if not s["n"]:
                    continue
                lead = f"{f:>6}{summary['prompt_tokens'].get(f) or 0:>8}" if first else " " * 14
                first = False
                hm = summary[f"ratio_{mode}_hit_vs_miss"][f]
                paired = summary["ratio_epd_hit_vs_miss_paired"][f].get("median") if mode == "epd" else None
                coloc = summary["ratio_epd_vs_colocated"][f][case] if mode == "epd" else None
                cached = summary["cached_tokens"][mode][f][case]
                print(f"{lead}  {mode:<10}{case:<6}{s['median']:>9.1f}{s['p90']:>9.1f}{s['n']:>4}"
                      f"{'-' if cached is None else f'{cached:g}':>11}{_x(hm) if case == 'hit' else '':>10}"
                      f"{_x(paired) if case == 'hit' else '':>8}{_x(coloc):>8}")
    print("TTFT in ms through the router: send -> first SSE chunk with content. miss: a video no stack has seen;")
    print("hit: the same bytes again with a different question written before the video, so the prefix cache")
    print("reuses only the chat template's head ('prefix hit': the KV server's prefix-cache hit tokens, median):")
    print("in epd only the embedding cache hits; colocated has no embedding cache (its hit is recomputed).")
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
        print_header(f"{'system':<10}{'stream':<11}{'TPOT p99':>9}{'p50':>8}{'ITL p99':>9}{'max':>8}{'in window':>10}"
                     f"{'video TTFT':>11}{'TPOT x':>8}{'ITL x':>7}")
        for mode, entry in t.items():
            for label in ("alone", "with_video"):
                s = entry[label]
                vt = s.get("video_ttft_ms", {}).get("median") if label == "with_video" else None
                print(f"{mode:<10}{label:<11}{_x(s['tpot_p99_ms'], '.1f', ''):>9}{_x(s['tpot_median_ms'], '.1f', ''):>8}"
                      f"{_x(s['itl_p99_ms'], '.1f', ''):>9}{_x(s['itl_max_ms'], '.0f', ''):>8}"
                      f"{_x(s.get('window_tpot_ms'), '.1f', ''):>10}{_x(vt, '.0f', ''):>11}"
                      f"{_x(entry['ratio_tpot_p99']) if label == 'with_video' else '':>8}"
                      f"{_x(entry['ratio_itl_p99']) if label == 'with_video' else '':>7}")
        print("ms. One long text stream (ignore_eos); 'with_video': a video request sent once it has its first tokens.")
        print("TPOT: (last token - first) / (tokens - 1) per stream, p99 over trials (nearest rank); ITL: its token")
        print("gaps pooled; 'in window': the mean gap while the video was in flight (sent -> its first token).")
    for where, error in summary.get("errors", {}).items():
        print(f"not measured: {where}: {error}")


def plot(summary: dict, runs: dict, frames: list[int], path: Path, title: str) -> None:
    """TTFT bars per frame count (system x case), encoder frames/s (batch 1 vs batched), the stream's
    token gaps over time with a video beside it (one trial per system)."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.4), gridspec_kw={"width_ratios": [2, 1, 2.2]})
    ax = axes[0]
    bars = [(m, c, col) for m, c, col in (("colocated", "miss", "grey"), ("colocated", "hit", "silver"),
                                          ("epd", "miss", "tab:red"), ("epd", "hit", "tab:green"))
            if m in summary["ttft_ms"]]
    width = 0.8 / max(1, len(bars))
    for j, (mode, case, colour) in enumerate(bars):
        for i, f in enumerate(map(str, frames)):
            s = summary["ttft_ms"][mode][f][case]
            if not s["n"]:
                continue
            x = i + (j - (len(bars) - 1) / 2) * width
            ax.bar(x, s["median"], width, yerr=[[0], [s["p90"] - s["median"]]], capsize=2, color=colour,
                   label=f"{mode} {case}" if i == 0 else None)
            label = f"{s['median']:.0f}"
            if mode == "epd" and case == "hit" and summary["ratio_epd_hit_vs_miss"][f] is not None:
                label += f"\n{summary['ratio_epd_hit_vs_miss'][f]:.2f}x"
            ax.text(x, s["median"], label, ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(frames)), [f"{f} frames\n({summary['prompt_tokens'].get(str(f))} tok)" for f in frames],
                  fontsize=8)
    ax.set_ylabel("TTFT ms (median, bar to p90)")
    ax.set_title("1-video chat: miss vs hit (label: epd hit/miss)", fontsize=9)
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
    """TTFT medians and ratios per frame count, encoder frames/s, the stream's TPOT p99 and its ratios."""
    out = []
    for f in map(str, frames):
        for mode in summary["ttft_ms"]:
            for case in ("miss", "hit"):
                out.append(Figure(f"{f} frames: TTFT p50, {mode} {case}",
                                  summary["ttft_ms"][mode][f][case].get("median"), "ms"))
        if "epd" in summary["ttft_ms"]:
            out.append(Figure(f"{f} frames: TTFT epd hit / epd miss (goal <= 0.3)",
                              summary["ratio_epd_hit_vs_miss"][f], "x"))
            if "colocated" in summary["ttft_ms"]:
                out += [Figure(f"{f} frames: TTFT epd / colocated, {c}", summary["ratio_epd_vs_colocated"][f][c], "x")
                        for c in ("miss", "hit")]
    e = summary.get("encoder")
    if e:
        for name, p in e["parts"].items():
            out.append(Figure(f"encoder frames/s, {name.replace('_', ' ')} ({e['frames_per_video']} frames a video)",
                              p["fps_wall_median"], "frames/s"))
        out.append(Figure("encoder frames/s batched / batch 1", e.get("ratio_batched_vs_1"), "x"))
    for mode, entry in summary["tpot"].items():
        out += [Figure(f"{mode}: stream TPOT p99, alone", entry["alone"]["tpot_p99_ms"], "ms"),
                Figure(f"{mode}: stream TPOT p99, video beside it", entry["with_video"]["tpot_p99_ms"], "ms"),
                Figure(f"{mode}: stream TPOT p99 with video / alone" + (" (goal <= 1.2)" if mode == "epd" else ""),
                       entry["ratio_tpot_p99"], "x"),
                Figure(f"{mode}: stream ITL p99 with video / alone", entry["ratio_itl_p99"], "x")]
    return out
