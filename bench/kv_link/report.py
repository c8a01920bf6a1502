"""What a run shows: the printed table, the plot and the summary's headline figures."""

from __future__ import annotations

from pathlib import Path

from bench.common.output import print_header, pyplot, save_figure
from bench.common.record import Figure
from bench.kv_link.analysis import GOAL_RATIO, LAYER_RATIO


def figures(results: list[dict]) -> list[Figure]:
    """Per backend and cell: ours / raw TCP, the raw library / raw TCP (bandwidth ratios) and raw TCP's GB/s."""
    out = []
    for result in results:
        for cell in result["cells"]:
            where = f"{result['backend']}, {cell['mib']} MiB {cell['layout']}"
            out += [Figure(f"{where}: ours / raw TCP", cell["ours_vs_tcp"], "x"),
                    Figure(f"{where}: raw library / raw TCP", cell["raw_vs_tcp"], "x"),
                    Figure(f"{where}: raw TCP", cell["paths"]["tcp"]["gbps"], "GB/s")]
    return out


def print_table(results: list[dict]) -> None:
    """Per backend, cell and path: median, p90, min, GB/s, this path / tcp, bytes on the link / payload."""
    print_header(f"{'backend':<9}{'MiB':>4} {'layout':<11}{'ops':>5}  {'path':<6}{'p50 ms':>9}{'p90 ms':>9}"
                 f"{'min ms':>9}{'GB/s':>7}{'/tcp':>7}{'wire':>7}{'opens':>6}  limit")
    for result in results:
        for cell in result["cells"]:
            for i, (p, r) in enumerate(cell["paths"].items()):
                lead = (f"{result['backend']:<9}{cell['mib']:>4} {cell['layout']:<11}{cell['ops']:>5}" if i == 0
                        else " " * 29)
                vs_tcp = cell["paths"]["tcp"]["median_ms"] / r["median_ms"]
                tail = (cell["limit"] or "-") if p == "ours" else ""
                print(f"{lead}  {p:<6}{r['median_ms']:>9.2f}{r['p90_ms']:>9.2f}{r['min_ms']:>9.2f}{r['gbps']:>7.2f}"
                      f"{vs_tcp:>6.2f}x{cell['wire'][p]['wire_ratio']:>7.3f}{cell['wire'][p]['tcp_opens']:>6}  {tail}")
        print()
    print(f"/tcp = raw TCP's median time / this path's (bandwidth ratio; goal for ours >= {GOAL_RATIO}); GB/s at the "
          f"median; wire = bytes the source's eth0 sent in one move / payload (>= 1: over the link); opens = TCP "
          f"connections the source opened for that move. limit: which "
          f"factor holds ours below the goal (library: raw / tcp < {GOAL_RATIO}; our layer: ours / raw < "
          f"{LAYER_RATIO})")


def plot(results: list[dict], path: Path, title: str) -> None:
    """GB/s of each path per cell (bars down to the p90 time), one panel per backend; labels ours / tcp."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(results), figsize=(6.0 * len(results), 4.6), squeeze=False)
    colors = {"ours": "tab:blue", "raw": "tab:orange", "tcp": "grey"}
    for ax, result in zip(axes[0], results):
        cells = result["cells"]
        labels = [f"{c['mib']} MiB\n{c['layout']}" for c in cells]
        width = 0.8 / 3
        for k, p in enumerate(("ours", "raw", "tcp")):
            xs = [i + (k - 1) * width for i in range(len(cells))]
            ys = [c["paths"][p]["gbps"] for c in cells]
            lo = [c["paths"][p]["gbps"] - c["paths"][p]["gbps_p90_time"] for c in cells]
            ax.bar(xs, ys, width, yerr=[lo, [0] * len(lo)], capsize=3, color=colors[p],
                   label={"ours": "ours", "raw": "raw library", "tcp": "raw TCP socket"}[p])
        for i, c in enumerate(cells):
            ax.annotate(f"{c['ours_vs_tcp']:.2f}x", (i - width, c["paths"]["ours"]["gbps"]),
                        textcoords="offset points", xytext=(0, 3), ha="center", fontsize=7, color="tab:blue")
        ax.set_xticks(range(len(cells)), labels, fontsize=8)
        ax.set_ylabel("GB/s at the median (bar down to p90 time)")
        ax.set_title(f"{result['backend']} (labels: ours / raw TCP, goal {GOAL_RATIO})", fontsize=10)
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    save_figure(fig, path, bbox_inches="tight")
