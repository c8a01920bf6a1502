"""What a run shows: the printed table, the plot and the summary's headline figures."""

from __future__ import annotations

from pathlib import Path

from bench.common.output import pyplot, save_figure
from bench.common.record import Figure
from bench.decode_throughput.analysis import TARGET_RATIO


def print_table(hf: dict, levels: list[dict]) -> None:
    """Wall-clock tokens/s (the measure) plus the CPU share each side got and tokens per CPU-second
    (a cross-check on a shared machine: the server's CPU time includes its HTTP threads)."""
    print()
    print(f"{'system':<28}{'streams':>8}{'reqs':>6}{'tokens':>8}{'wall s':>8}{'tok/s':>8}{'vs HF':>8}"
          f"{'cpu share':>10}{'tok/cpu-s':>10}{'vs HF':>8}")
    print("-" * 96)
    print(f"{'HF generate (1 at a time)':<28}{1:>8}{hf['requests']:>6}{hf['completion_tokens']:>8}"
          f"{hf['seconds']:>8.2f}{hf['tokens_per_s']:>8.1f}{1.0:>7.2f}x{hf['cpu_share']:>10.2f}"
          f"{hf['tokens_per_cpu_s']:>10.1f}{1.0:>7.2f}x")
    for level in levels:
        print(f"{'stage serve colocated':<28}{level['concurrency']:>8}{level['requests']:>6}"
              f"{level['completion_tokens']:>8}{level['wall_s']:>8.2f}{level['tokens_per_s']:>8.1f}"
              f"{level['ratio_vs_hf']:>7.2f}x{level['server_cpu_share']:>10.2f}"
              f"{level.get('tokens_per_server_cpu_s') or 0:>10.1f}{level.get('cpu_normalized_ratio_vs_hf') or 0:>7.2f}x")
    print()


def plot(hf: dict, levels: list[dict], path: Path, title: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs = [level["concurrency"] for level in levels]
    ys = [level["tokens_per_s"] for level in levels]
    ax.plot(xs, ys, "o-", label="stage serve colocated")
    for x, y, level in zip(xs, ys, levels):
        ax.annotate(f"{y:.0f} ({level['ratio_vs_hf']:.1f}x)", (x, y), textcoords="offset points", xytext=(4, 6),
                    fontsize=8)
    ax.axhline(hf["tokens_per_s"], color="grey", linestyle="--", label=f"HF generate, 1 at a time ({hf['tokens_per_s']:.0f})")
    ax.axhline(TARGET_RATIO * hf["tokens_per_s"], color="tab:red", linestyle=":", label=f"goal: {TARGET_RATIO:.0f}x HF")
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("output tokens / s")
    ax.set_ylim(bottom=0)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    save_figure(fig, path)


def figures(hf: dict, levels: list[dict]) -> list[Figure]:
    """HF's tokens/s, and per level ours' tokens/s and ours / HF."""
    out = [Figure("HF generate(), 1 at a time", hf["tokens_per_s"], "tok/s")]
    for level in levels:
        streams = level["concurrency"]
        out += [Figure(f"{streams} streams", level["tokens_per_s"], "tok/s"),
                Figure(f"{streams} streams / HF generate()", level["ratio_vs_hf"], "x")]
    return out
