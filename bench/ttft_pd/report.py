"""What a run shows: the printed table, the plot and the summary's headline figures."""

from __future__ import annotations

from pathlib import Path

from bench.common.output import print_header, pyplot, save_figure
from bench.common.record import Figure


def figures(phases: list[dict], ratios: dict[str, dict[str, float]], workloads: list[str]) -> list[Figure]:
    """Per workload: each system's TTFT median, and each PD pair's TTFT over colocated's."""
    out = []
    for w in workloads:
        out += [Figure(f"{w}: TTFT p50, {p['phase']}", p["workloads"][w]["ttft_ms_median"], "ms") for p in phases]
        out += [Figure(f"{w}: TTFT {name} / colocated", by_workload[w], "x") for name, by_workload in ratios.items()]
    return out


def print_table(phases: list[dict], workloads: list[str]) -> None:
    """Per workload and system: TTFT median, p90, min, PD / colocated, the KV write, the same-text check."""
    base = next((p for p in phases if p["phase"] == "colocated"), None)
    print_header(f"{'workload':<12}{'prompt':>7}  {'system':<14}{'TTFT p50':>9}{'p90':>9}{'min':>9}{'PD/coloc':>10}"
                 f"{'KV write':>10}{'KV MiB':>8}{'KV GB/s':>9}{'same text':>10}")
    for w in workloads:
        for i, phase in enumerate(phases):
            s = phase["workloads"][w]
            ratio = f"{s['ttft_ms_median'] / base['workloads'][w]['ttft_ms_median']:.2f}x" if base else "-"
            kv = (f"{s['kv_write_ms_median']:>8.2f}ms{s['kv_bytes'] / 2**20:>8.2f}{s['kv_gbps_median'] or 0:>9.2f}"
                  if "kv_write_ms_median" in s else f"{'':>10}{'':>8}{'':>9}")
            same = "" if phase["phase"] == "colocated" or not base else \
                ("yes" if phase["texts"][w] == base["texts"][w] and phase["distinct_texts"][w] == 1 else "NO")
            lead = f"{w:<12}{s['prompt_tokens'] or 0:>7}" if i == 0 else " " * 19
            print(f"{lead}  {phase['phase']:<14}{s['ttft_ms_median']:>9.1f}{s['ttft_ms_p90']:>9.1f}{s['ttft_ms_min']:>9.1f}"
                  f"{ratio:>10}{kv}{same:>10}")
        print()
    print("TTFT in ms: send -> first SSE chunk with content (decode's stream for PD); PD/coloc = ratio of the medians")


def plot(phases: list[dict], workloads: list[str], path: Path, title: str) -> None:
    """One panel per workload (own y scale): TTFT median per system, bar to p90, KV write hatched, PD/colocated."""
    plt = pyplot()
    base = next((p for p in phases if p["phase"] == "colocated"), None)
    colors = {"colocated": "grey", "pd-mooncake": "tab:blue", "pd-nixl": "tab:orange"}
    fig, axes = plt.subplots(1, len(workloads), figsize=(3.6 * len(workloads), 4.2), squeeze=False)
    for ax, w in zip(axes[0], workloads):
        for i, phase in enumerate(phases):
            s = phase["workloads"][w]
            ax.bar(i, s["ttft_ms_median"], 0.7, yerr=[[0], [s["ttft_ms_p90"] - s["ttft_ms_median"]]], capsize=3,
                   color=colors.get(phase["phase"]))
            if "kv_write_ms_median" in s:
                ax.bar(i, s["kv_write_ms_median"], 0.7, color="black", alpha=0.4, hatch="//")
            label = f"{s['ttft_ms_median']:.0f} ms"
            if base and phase is not base:
                label += f"\n{s['ttft_ms_median'] / base['workloads'][w]['ttft_ms_median']:.2f}x"
            ax.text(i, s["ttft_ms_median"] / 2, label, ha="center", va="center", fontsize=8, color="white")
        ax.set_xticks(range(len(phases)), [p["phase"] for p in phases], fontsize=8)
        ax.set_title(f"{w} ({phases[0]['workloads'][w]['prompt_tokens']} prompt tokens)", fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].set_ylabel("TTFT ms (median, bar to p90; hatched: KV write)")
    fig.suptitle(title, fontsize=9)
    save_figure(fig, path)
