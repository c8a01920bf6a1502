"""What a run shows: the printed tables (TTFT; PD's breakdown), the plot and the summary's headline figures."""

from __future__ import annotations

from pathlib import Path

from bench.common.output import print_header, pyplot, save_figure
from bench.common.record import Figure
from bench.ttft_pd.analysis import CHAIN, SIDE, same_texts
from bench.ttft_pd.workload import CACHE

BREAKDOWN_FIGURES = ("text_short",)  # workloads whose breakdown medians go into the summary (all are in the JSON)


def label(workload: str) -> str:
    """``text_short (miss)``: the workload and whether it measures a prefix-cache hit or a miss."""
    return f"{workload} ({CACHE.get(workload, '?')})"


def figures(phases: list[dict], ratios: dict[str, dict[str, float]], workloads: list[str]) -> list[Figure]:
    """Per workload: each system's TTFT median, each PD pair's TTFT over colocated's; for the
    ``BREAKDOWN_FIGURES`` workloads each PD pair's breakdown medians (the chain)."""
    out = []
    for w in workloads:
        out += [Figure(f"{label(w)}: TTFT p50, {p['phase']}", p["workloads"][w]["ttft_ms_median"], "ms") for p in phases]
        out += [Figure(f"{label(w)}: TTFT {name} / colocated", by_workload[w], "x") for name, by_workload in ratios.items()]
        if w not in BREAKDOWN_FIGURES:
            continue
        for p in phases:
            b = p["workloads"][w].get("breakdown_ms_median")
            if b:
                out += [Figure(f"{label(w)}: {p['phase']} {name} ({what}) p50", b[name], "ms") for name, what in CHAIN]
    return out


def print_table(phases: list[dict], workloads: list[str]) -> None:
    """Per workload and system: hit or miss, TTFT median, p90, min, PD / colocated, the KV write, the same-text check."""
    base = next((p for p in phases if p["phase"] == "colocated"), None)
    print_header(f"{'workload':<12}{'cache':>6}{'prompt':>7}{'cached':>7}  {'system':<12}{'TTFT p50':>9}{'p90':>8}"
                 f"{'min':>8}{'PD/coloc':>9}{'KV write':>10}{'KV MiB':>8}{'KV GB/s':>8}{'same text':>10}")
    for w in workloads:
        for i, phase in enumerate(phases):
            s = phase["workloads"][w]
            ratio = f"{s['ttft_ms_median'] / base['workloads'][w]['ttft_ms_median']:.2f}x" if base else "-"
            kv = (f"{s['kv_write_ms_median']:>8.2f}ms{s['kv_bytes'] / 2**20:>8.2f}{s['kv_gbps_median'] or 0:>8.2f}"
                  if "kv_write_ms_median" in s else f"{'':>10}{'':>8}{'':>8}")
            same = "" if phase["phase"] == "colocated" or not base else ("yes" if same_texts(phase, base, w) else "NO")
            lead = f"{w:<12}{CACHE.get(w, '?'):>6}{s['prompt_tokens'] or 0:>7}" if i == 0 else " " * 25
            cached = s["cached_tokens_median"]
            print(f"{lead}{'-' if cached is None else f'{cached:g}':>7}  {phase['phase']:<12}{s['ttft_ms_median']:>9.1f}"
                  f"{s['ttft_ms_p90']:>8.1f}{s['ttft_ms_min']:>8.1f}{ratio:>9}{kv}{same:>10}")
        print()
    print("TTFT in ms: send -> first SSE chunk with content (decode's stream for PD); PD/coloc = ratio of the medians;\n"
          "cache: miss = every timed prompt unseen (its own number leads the system turn), hit = one prompt repeated;\n"
          "cached = the median prompt tokens the prefix cache gave (usage.prompt_tokens_details)")


def print_breakdown(phases: list[dict], workloads: list[str]) -> None:
    """Per workload and PD system: the breakdown medians (ms) of its TTFT, the chain then the side phases."""
    names = [name for name, _ in CHAIN] + ["unaccounted"] + [name for name, _ in SIDE]
    print_header(f"{'workload':<18}{'system':<13}{'TTFT':>7}" + "".join(f"{n[:11]:>12}" for n in names))
    for w in workloads:
        for phase in phases:
            b = phase["workloads"][w].get("breakdown_ms_median")
            if not b:
                continue
            cells = "".join(f"{'-' if b[n] is None else f'{b[n]:.2f}':>12}" for n in names)
            print(f"{label(w):<18}{phase['phase']:<13}{phase['workloads'][w]['ttft_ms_median']:>7.1f}{cells}")
    print("PD TTFT by phase, medians in ms over the requests (each phase's own median: they need not add up to the "
          "TTFT median):\n" + "\n".join(f"  {name:<16}{what}" for name, what in CHAIN + SIDE)
          + "\n  unaccounted     TTFT - the chain's sum (- the embeddings wait)")


def plot(phases: list[dict], workloads: list[str], path: Path, title: str) -> None:
    """One panel per workload (own y scale): TTFT median per system, bar to p90; PD bars stacked by
    breakdown phase (medians, scaled to the TTFT median), PD/colocated."""
    plt = pyplot()
    base = next((p for p in phases if p["phase"] == "colocated"), None)
    colors = {"colocated": "grey", "pd-mooncake": "tab:blue", "pd-nixl": "tab:orange"}
    shades = plt.get_cmap("tab10")
    fig, axes = plt.subplots(1, len(workloads), figsize=(3.6 * len(workloads), 4.6), squeeze=False)
    for ax, w in zip(axes[0], workloads):
        for i, phase in enumerate(phases):
            s = phase["workloads"][w]
            ax.bar(i, s["ttft_ms_median"], 0.7, yerr=[[0], [s["ttft_ms_p90"] - s["ttft_ms_median"]]], capsize=3,
                   color=colors.get(phase["phase"]), alpha=0.35 if s.get("breakdown_ms_median") else 1.0)
            b = s.get("breakdown_ms_median")
            if b:
                chain = [max(0.0, b[name] or 0.0) for name, _ in CHAIN]
                scale = s["ttft_ms_median"] / sum(chain) if sum(chain) else 0.0
                bottom = 0.0
                for k, ((name, _), value) in enumerate(zip(CHAIN, chain)):
                    ax.bar(i, value * scale, 0.5, bottom=bottom, color=shades(k),
                           label=name if i == len(phases) - 1 and ax is axes[0][0] else None)
                    bottom += value * scale
            label_text = f"{s['ttft_ms_median']:.0f} ms"
            if base and phase is not base:
                label_text += f"\n{s['ttft_ms_median'] / base['workloads'][w]['ttft_ms_median']:.2f}x"
            ax.text(i, s["ttft_ms_median"] * 1.02, label_text, ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(phases)), [p["phase"] for p in phases], fontsize=8)
        ax.set_title(f"{label(w)} ({phases[0]['workloads'][w]['prompt_tokens']} prompt tokens)", fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].set_ylabel("TTFT ms (median, bar to p90; PD stacked by phase)")
    axes[0][0].legend(fontsize=6, loc="upper left")
    fig.suptitle(title, fontsize=9)
    save_figure(fig, path)
