"""What a run shows: a line per phase as it ends, the table, the plot and the summary's figures."""

from __future__ import annotations

import statistics
from pathlib import Path

from bench.common.output import print_header, pyplot, save_figure
from bench.common.record import Figure
from bench.epd_cache.analysis import WAKE_GOAL_MS


def print_phase(run: dict, counts: list[int]) -> None:
    """A phase's TTFT medians per N, its burst and its load, as it ends."""
    timed = [s for s in run["samples"] if not s["warmup"]]
    for n in counts:
        parts = []
        for case in ("miss", "hit"):
            ttft = [1e3 * s["ttft_s"] for s in timed if s["n"] == n and s["case"] == case]
            if ttft:
                parts.append(f"{case} {statistics.median(ttft):.1f} ms")
        print(f"[{run['phase']} r{run['round']}] {n} images: TTFT median " + ", ".join(parts), flush=True)
    if run["burst"]:
        b = run["burst"]
        print(f"[{run['phase']} r{run['round']}] burst: {b['encoded']:g} encodes for {b['unique_images']} unique images "
              f"in {b['requests']} requests at c={b['concurrency']}, statuses {b['statuses']}", flush=True)
    m = run["measure"]
    print(f"[{run['phase']} r{run['round']}] load {m['loadavg_1m']}, core busy {m['core_busy_fraction']}, "
          f"server CPU s {m['server_cpu_s']}", flush=True)


def print_table(summary: dict, counts: list[int]) -> None:
    """Per N, system and case: TTFT median, p90, min, hit / miss, paired, epd / colocated, stage CPU."""
    ttft, ratios = summary["ttft_ms"], summary.get("ratio_hit_vs_miss", {})
    print_header(f"{'images':>6}{'prompt':>8}  {'system':<10}{'case':<6}{'TTFT p50':>9}{'p90':>9}{'min':>9}{'n':>4}"
                 f"{'hit/miss':>10}{'paired':>8}{'/coloc':>8}{'CPU ms':>8}{'hit/miss':>10}")
    for n in counts:
        first = True
        for mode in ttft:
            for case in ("miss", "hit"):
                s = ttft[mode][str(n)][case]
                if not s["n"]:
                    continue
                ratio = f"{ratios[str(n)]:.2f}x" if mode == "epd" and case == "hit" and str(n) in ratios else ""
                paired = f"{summary['ratio_hit_vs_miss_paired'][str(n)]['median']:.2f}x" if ratio else ""
                coloc = summary.get("ratio_epd_vs_colocated", {}).get(str(n), {}).get(case) if mode == "epd" else None
                lead = f"{n:>6}{summary['prompt_tokens'][str(n)] or 0:>8}" if first else " " * 14
                first = False
                cpu = summary["cpu_ms"][mode][str(n)]
                cpu_ratio = f"{cpu['hit']['stages_median'] / cpu['miss']['stages_median']:.2f}x" \
                    if mode == "epd" and case == "hit" and cpu["miss"]["stages_median"] else ""
                print(f"{lead}  {mode:<10}{case:<6}{s['median']:>9.1f}{s['p90']:>9.1f}{s['min']:>9.1f}{s['n']:>4}"
                      f"{ratio:>10}{paired:>8}{f'{coloc:.2f}x' if coloc else '':>8}{cpu[case]['stages_median']:>8.0f}"
                      f"{cpu_ratio:>10}")
        print()
    print("TTFT in ms: send -> first SSE chunk with content, through the router. colocated has no cache: its")
    print("'hit' is the same body computed again. hit/miss: ratio of the epd medians (goal <= 0.5); paired: median")
    print("of each hit's TTFT over its own miss's (sent 0.25 s apart: less moved by drifting outside load). CPU ms: the")
    print("stage servers' CPU per request (median of E+P+D, or colocated; /proc, 10 ms ticks), steadier than TTFT")
    print("when other work shares the cores.")
    if "encoder_calls" in summary:
        e, w = summary["encoder_calls"], summary["wake_ms"]
        print(f"encoder calls per unique image: TTFT workload {e['ttft_workload']['calls_per_unique_image']} "
              f"({e['ttft_workload']['encoded']:g} encodes / {e['ttft_workload']['unique_images']} images), burst "
              f"{e['burst']['calls_per_unique_image']} ({e['burst']['encoded']:g} / {e['burst']['unique_images']}), "
              f"overall {e['overall_calls_per_unique_image']} (goal 1.0); requests with a wrong count: "
              f"{len(e['requests_with_a_wrong_count'])}")
        print(f"misses whose prefill waited for its last image: {w['waited']} of {w['misses']}")
        for name, a in (("landing", w["all"]), ("created_at (upper bound)", w["upper_bound"])):
            if a["n"]:
                print(f"{name} -> waiting prefill starts: p50 {a['median']:.2f} ms, p90 {a['p90']:.2f}, "
                      f"min {a['min']:.2f}, max {a['max']:.2f} (goal p50 < {WAKE_GOAL_MS:g} ms)")
        h = summary["hit_queued_to_embeddings_ready_ms"]
        print(f"hits, queued -> embeddings_ready (the cached entries read and checked): p50 {h['median']:.2f} ms")


def plot(summary: dict, runs: dict[str, list[dict]], counts: list[int], path: Path, title: str) -> None:
    """TTFT bars per N (epd miss, epd hit, colocated), the wake CDF, encoder calls per unique image."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.4), gridspec_kw={"width_ratios": [2.2, 1.4, 1]})
    ax = axes[0]
    bars = [("epd", "miss", "tab:red"), ("epd", "hit", "tab:green"), ("colocated", "miss", "grey"),
            ("colocated", "hit", "silver")]
    bars = [b for b in bars if b[0] in summary["ttft_ms"]]
    width = 0.8 / len(bars)
    for j, (mode, case, color) in enumerate(bars):
        for i, n in enumerate(counts):
            s = summary["ttft_ms"][mode][str(n)][case]
            if not s["n"]:
                continue
            x = i + (j - (len(bars) - 1) / 2) * width
            ax.bar(x, s["median"], width, yerr=[[0], [s["p90"] - s["median"]]], capsize=2, color=color,
                   label=f"{mode} {case if mode == 'epd' else ('(same body)' if case == 'miss' else '(again)')}"
                   if i == 0 else None)
            label = f"{s['median']:.0f}"
            if mode == "epd" and case == "hit":
                label += f"\n{summary['ratio_hit_vs_miss'][str(n)]:.2f}x"
            ax.text(x, s["median"], label, ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(counts)), [f"{n} image{'s' if n > 1 else ''}\n({summary['prompt_tokens'][str(n)]} tok)"
                                       for n in counts], fontsize=8)
    ax.set_ylabel("TTFT ms (median, bar to p90)")
    ax.set_title("TTFT: cached (hit) vs not (miss); label: hit/miss", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(axis="y", alpha=0.3)
    ax = axes[1]
    waited = [s for run in runs.get("epd", []) for s in run["samples"] if s.get("waited")]
    exact = sorted(s["wake_ms"] for s in waited if "wake_ms" in s)
    upper = sorted(s["wake_upper_ms"] for s in waited)
    for values, label, color in ((exact, "from landing", "tab:blue"),
                                 (upper, "from created_at (upper bound)", "tab:cyan")):
        if values:
            ax.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post", label=label, color=color)
    ax.axvline(WAKE_GOAL_MS, color="red", linestyle="--", label=f"goal p50 {WAKE_GOAL_MS:g} ms")
    ax.axhline(0.5, color="grey", linewidth=0.5)
    ax.set_xlabel("embedding landed -> prefill starts (ms)")
    ax.set_ylabel("fraction of misses that waited")
    ax.set_title("wake latency (CDF)", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    ax = axes[2]
    if "encoder_calls" in summary:
        e = summary["encoder_calls"]
        names = ["TTFT\nworkload", "concurrent\nburst", "overall"]
        values = [e["ttft_workload"]["calls_per_unique_image"], e["burst"]["calls_per_unique_image"],
                  e["overall_calls_per_unique_image"]]
        ax.bar(range(3), [v or 0 for v in values], 0.6, color="tab:purple")
        for i, v in enumerate(values):
            ax.text(i, (v or 0), f"{v}", ha="center", va="bottom", fontsize=8)
        ax.axhline(1.0, color="red", linestyle="--", label="goal 1.0")
        ax.set_xticks(range(3), names, fontsize=8)
        ax.set_ylim(0, max(1.5, max(v or 0 for v in values) * 1.2))
        ax.legend(fontsize=7)
    ax.set_title("encoder calls per unique image", fontsize=9)
    fig.suptitle(title, fontsize=9)
    save_figure(fig, path)


def figures(summary: dict, counts: list[int]) -> list[Figure]:
    """Per N: TTFT hit / miss (medians, and paired), stage CPU hit / miss, epd miss / colocated; encoder
    calls per unique image; the wake's p50 and p90 (from the landing, else the upper bound)."""
    if "ratio_hit_vs_miss" not in summary:
        return []
    out = []
    for n in map(str, counts):
        images = f"{n} image{'s' if n != '1' else ''}"
        out += [Figure(f"TTFT hit / miss, {images}", summary["ratio_hit_vs_miss"][n], "x"),
                Figure(f"TTFT hit / miss paired (median), {images}", summary["ratio_hit_vs_miss_paired"][n].get("median"),
                       "x"),
                Figure(f"stage CPU hit / miss, {images}", summary["ratio_hit_vs_miss_cpu"][n], "x")]
        coloc = summary["ratio_epd_vs_colocated"].get(n)
        if coloc:
            out.append(Figure(f"TTFT epd miss / colocated, {images}", coloc["miss"], "x"))
    wake = summary["wake_ms"]["all"] if summary["wake_ms"]["all"]["n"] else summary["wake_ms"]["upper_bound"]
    source = "landing" if summary["wake_ms"]["all"]["n"] else "created_at (upper bound)"
    out += [Figure("encoder calls per unique image", summary["encoder_calls"]["overall_calls_per_unique_image"],
                   "calls"),
            Figure(f"wake p50, {source} -> waiting prefill starts", wake.get("median"), "ms"),
            Figure(f"wake p90, {source} -> waiting prefill starts", wake.get("p90"), "ms")]
    return out
