"""What a run shows: the printed table, the plot and the summary's headline figures."""

from __future__ import annotations

from pathlib import Path

from bench.common.output import print_header, pyplot, save_figure
from bench.common.record import Figure

FIGURE_TOKENS = (2048, 8192)  # the cells whose ratios the summary keeps (16 and 64 MiB on the small model)


def figures(results: list[dict]) -> list[Figure]:
    """Per backend and layout, at each of ``FIGURE_TOKENS``: ours / raw and ours / memcpy (bandwidth)."""
    out = []
    for result in results:
        for cell in result["cells"]:
            if cell["tokens"] in FIGURE_TOKENS:
                where = f"{result['backend']}, {cell['tokens']} tokens ({cell['bytes'] / 2**20:.0f} MiB), {cell['layout']}"
                out += [Figure(f"{where}: ours / raw", cell["ratio_ours_vs_raw"], "x"),
                        Figure(f"{where}: ours / memcpy", cell["ratio_vs_memcpy"]["ours"], "x")]
    return out


def print_table(results: list[dict]) -> None:
    """Per backend, cell and path: median, p90, min, GB/s, / raw, / memcpy; then the breakdown of our layer."""
    print_header(f"{'backend':<9}{'tokens':>7} {'layout':<11}{'ops':>5}{'MiB':>7}  {'path':<15}{'p50 ms':>9}{'p90 ms':>9}"
                 f"{'min ms':>9}{'GB/s':>8}{'/raw':>7}{'/memcpy':>9}")
    for result in results:
        for cell in result["cells"]:
            for i, (p, r) in enumerate(cell["paths"].items()):
                lead = (f"{result['backend']:<9}{cell['tokens']:>7} {cell['layout']:<11}{cell['ops']:>5}"
                        f"{cell['bytes'] / 2**20:>7.1f}") if i == 0 else " " * 39
                vs_raw = cell["paths"]["raw"]["median_ms"] / r["median_ms"]
                vs_mem = cell["paths"]["memcpy"]["median_ms"] / r["median_ms"]
                print(f"{lead}  {p:<15}{r['median_ms']:>9.3f}{r['p90_ms']:>9.3f}{r['min_ms']:>9.3f}{r['gbps']:>8.2f}"
                      f"{vs_raw:>6.2f}x"
                      f"{vs_mem:>8.2f}x")
        print()
    print("/raw = raw median time / this path's median time (bandwidth ratio; goal for ours >= 0.9); /memcpy likewise;"
          " GB/s at the median")
    print()
    print("breakdown of our layer, parts timed in isolation (median us):")
    for result in results:
        for cell in result["cells"]:
            parts = ", ".join(f"{k} {v}" for k, v in cell["breakdown"].items() if k != "raw_phases")
            print(f"  {result['backend']:<9}{cell['tokens']:>6} {cell['layout']:<11} ours-raw "
                  f"{cell['ours_minus_raw_us']:>8.1f} us (min-based ratio {cell['ratio_ours_vs_raw_best']:.2f}) | {parts}")
            if "split_us" in cell:
                print(f"  {'':<28}ours - raw = thread hop (raw_in_thread - raw) {cell['split_us']['thread_hop']} us"
                      f" + rest of our layer (ours - raw_in_thread) {cell['split_us']['rest_of_layer']} us")
            if "raw_phases" in cell["breakdown"]:
                print(f"  {'':<28}raw nixl phases: {cell['breakdown']['raw_phases']}")


def plot(results: list[dict], path: Path, title: str) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, len(results), figsize=(6.5 * len(results), 4.8), squeeze=False)
    colors = {"ours": "tab:blue", "raw": "tab:orange", "raw_sync": "tab:green", "raw_sleep_poll": "tab:green",
              "raw_in_thread": "tab:purple", "memcpy": "grey"}
    for ax, result in zip(axes[0], results):
        for layout, style in (("contiguous", "-"), ("fragmented", "--")):
            cells = [c for c in result["cells"] if c["layout"] == layout]
            xs = [c["tokens"] for c in cells]
            for p in cells[0]["paths"]:
                ys = [c["paths"][p]["gbps"] for c in cells]
                lo = [c["paths"][p]["gbps"] - c["paths"][p]["gbps_p90_time"] for c in cells]
                ax.errorbar(xs, ys, yerr=[lo, [0] * len(lo)], fmt="o" + style, color=colors.get(p, None),
                            capsize=3, label=f"{p} ({layout})", alpha=0.9 if layout == "contiguous" else 0.6)
            for c in cells:
                ax.annotate(f"{c['ratio_ours_vs_raw']:.2f}x", (c["tokens"], c["paths"]["ours"]["gbps"]),
                            textcoords="offset points", xytext=(4, -12 if layout == "fragmented" else 6), fontsize=7,
                            color="tab:blue")
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_xlabel("prompt tokens (solid: contiguous remote blocks, dashed: fragmented)")
        ax.set_ylabel("GB/s at the median (bar down to p90 time), log scale")
        ax.set_yscale("log")
        ax.set_title(f"{result['backend']} (labels: ours/raw)", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.17))
    fig.suptitle(title, fontsize=10)
    save_figure(fig, path, bbox_inches="tight")
