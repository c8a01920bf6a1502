"""PNG plots of a compare run (matplotlib, the bench extra, imported when called): one panel per metric
with a group of bars per workload and one bar per deployment, each labelled with its ratio against
colocated; and per workload, the latency CDFs of every deployment (``bench.serve.plots``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from bench.common.output import pyplot, save_figure
from bench.compare.report import COLUMNS, RATIO_OF
from bench.serve.plots import latency_cdfs


def bars(report: dict, path: Path) -> None:
    """``compare.png``: TTFT p50/p99, TPOT p50/p99, goodput, E2E p50 (one panel each)."""
    plt = pyplot()
    panels = [c for c in COLUMNS if c[0] != "E2E p99"]
    workloads = [w["name"] for w in report["config"]["workloads"]]
    modes = [m for m, d in report["deployments"].items() if d.get("workloads")]
    width = 0.8 / max(1, len(modes))
    fig, axes = plt.subplots(2, 3, figsize=(15, 7.5))
    for ax, (title, key, _) in zip(axes.flat, panels):
        x = np.arange(len(workloads))
        for i, mode in enumerate(modes):
            results = report["deployments"][mode]["workloads"]
            values = [results.get(w, {}).get(key) for w in workloads]
            heights = [np.nan if v is None else v for v in values]
            drawn = ax.bar(x + (i - (len(modes) - 1) / 2) * width, heights, width, label=mode)
            times = report["ratios"].get(mode, {})
            labels = [_label(times.get(w, {}).get(RATIO_OF[key])) for w in workloads]
            ax.bar_label(drawn, labels=labels, fontsize=6, rotation=90, padding=2)
        ax.set_title(title + (" (requests/s meeting the SLO)" if key == "request_goodput" else " (ms)"), fontsize=9)
        ax.set_xticks(x, workloads, fontsize=7)
        ax.margins(y=0.25)
        ax.grid(axis="y", alpha=0.3)
    axes.flat[0].legend(fontsize=7)
    slo = ", ".join(f"{k}<={v:g}" for k, v in report["config"]["slo"].items())
    fig.suptitle(f"colocated vs 1P1D (pd) vs 1E1P1D (epd), {report['config']['model_name']}, "
                 f"{report['machine']['cpu_count']} cores; labels: ratio vs colocated; SLO {slo}", fontsize=9)
    save_figure(fig, path, dpi=110)


def cdfs(report: dict, samples: dict[str, dict[str, dict]], folder: Path) -> list[Path]:
    """``compare_cdf_<workload>.png`` for each workload: TTFT, TPOT, ITL, E2EL CDFs, one line per
    deployment. ``samples``: mode -> workload -> ``bench.serve.metrics.per_request`` samples."""
    paths = []
    for workload in report["config"]["workloads"]:
        name = workload["name"]
        runs = [(mode, by_workload[name]) for mode, by_workload in samples.items() if name in by_workload]
        if runs:
            path = folder / f"compare_cdf_{name}.png"
            latency_cdfs(runs, path, f"{name}: {workload['what']}")
            paths.append(path)
    return paths


def _label(times: float | None) -> str:
    return "" if times is None else f"{times:.2f}x"
