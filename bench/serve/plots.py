"""PNG plots of ``stage bench serve`` runs (matplotlib, the bench extra, imported when called)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from bench.common.output import pyplot, save_figure
from bench.serve.report import HEADERS


def latency_cdfs(runs: list[tuple[str, dict[str, list[float]]]], path: Path, title: str) -> None:
    """One panel per latency (TTFT, TPOT, ITL, E2EL): the CDF of its samples (seconds, ``metrics.per_request``)
    for each ``(label, samples)`` run, in ms."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(HEADERS), figsize=(4.2 * len(HEADERS), 3.8))
    for ax, (name, (short, header)) in zip(axes, HEADERS.items()):
        for label, samples in runs:
            values = np.sort(np.asarray(samples[name], dtype=float)) * 1e3
            if values.size:
                ax.step(values, np.arange(1, values.size + 1) / values.size, where="post", label=label)
        ax.set_title(header, fontsize=9)
        ax.set_xlabel(f"{short} (ms)")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("fraction of requests (ITL: of gaps)")
    if len(runs) > 1:
        axes[-1].legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    save_figure(fig, path, dpi=110)


def latency_vs_rate(results: list[dict], path: Path, title: str) -> None:
    """A sweep: for each configured request rate (x, in sweep order), the p50 and p99 of TTFT, TPOT and
    E2EL, and the achieved request and output-token throughput."""
    plt = pyplot()
    x = np.arange(len(results))
    labels = [str(r["request_rate"]) for r in results]
    fig, axes = plt.subplots(1, 4, figsize=(16.8, 3.8))
    for ax, name in zip(axes, ("ttft", "tpot", "e2el")):
        for stat, style in (("median", "o-"), ("p99", "s--")):
            values = [r[f"{stat}_{name}_ms"] for r in results]
            ax.plot(x, [np.nan if v is None else v for v in values], style, label=stat)
        ax.set_title(HEADERS[name][1], fontsize=9)
        ax.set_ylabel(f"{HEADERS[name][0]} (ms)")
    ax = axes[3]
    ax.plot(x, [r["request_throughput"] or 0 for r in results], "o-", label="requests/s")
    ax.set_ylabel("requests/s")
    twin = ax.twinx()
    twin.plot(x, [r["output_throughput"] or 0 for r in results], "s--", color="tab:orange", label="output tok/s")
    twin.set_ylabel("output tokens/s")
    ax.set_title("Throughput achieved", fontsize=9)
    for ax in axes:
        ax.set_xticks(x, labels)
        ax.set_xlabel("request rate (req/s)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper left")
    twin.legend(fontsize=7, loc="lower right")
    fig.suptitle(title, fontsize=9)
    save_figure(fig, path, dpi=110)
