"""The soak's table, plot and summary figures."""

from __future__ import annotations

from pathlib import Path

from bench.common.output import print_header, pyplot, save_figure
from bench.common.record import Figure
from bench.soak.analysis import METRICS, series

LABELS = {"rss_mib": "RSS - its first sample (MiB)", "fds": "open fds", "threads": "threads"}


def print_table(report: dict) -> None:
    """The ramp, the hold's rate and answers, and each process's growth per metric."""
    print_header("ramp: concurrency  200s/s  refused")
    for s in report["ramp"]:
        print(f"      {s['concurrency']:>11}  {s['ok_per_s']:>6}  {s['refused']:>7}")
    hold = report["hold"]
    print(f"capacity {report['capacity_per_s']} req/s; hold target {hold['target_per_s']} req/s, "
          f"achieved {hold['achieved_ok_per_s']} 200s/s over {hold['duration_s']} s, skipped {hold['skipped']}; "
          f"answers {report['verdict']['outcomes']['by_status']}")
    print_header("process  metric    first    last   growth  bound  slope/min")
    for name, metrics in report["growth"].items():
        for metric, g in metrics.items():
            print(f"{name:<8} {metric:<8} {g.get('first')!s:>6} {g.get('last')!s:>7} {g.get('growth')!s:>7} "
                  f"{g.get('bound')!s:>6} {g.get('slope_per_min')!s:>9}")
    print(f"verdict: {'PASS' if report['verdict']['ok'] else 'FAIL'} {report['verdict']['reasons']}")


def plot(report: dict, path: Path, title: str) -> None:
    """One panel per metric: each process's series over the hold (RSS as growth over its first sample,
    so MiB of growth show beside GiB of RSS), the warm-up shaded."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(METRICS), figsize=(15, 4.2))
    for ax, metric in zip(axes, METRICS):
        for name in report["growth"]:
            points = series(report["samples"], name, metric)
            base = points[0][1] if points and metric == "rss_mib" else 0.0
            ax.plot([t / 60 for t, _ in points], [v - base for _, v in points], marker=".", label=name)
        ax.axvspan(0, report["warmup_s"] / 60, color="grey", alpha=0.15, label="warm-up")
        ax.set_xlabel("minutes into the hold")
        ax.set_ylabel(LABELS[metric])
        ax.legend(fontsize=8)
    fig.suptitle(title)
    save_figure(fig, path)


def figures(report: dict) -> list[Figure]:
    """Capacity, the hold's target and achieved rates, its duration, answers not allowed, and each
    process's RSS, fd and thread growth."""
    hold = report["hold"]
    out = [Figure("capacity (ramp, 200s per second)", report["capacity_per_s"], "req/s"),
           Figure("hold target rate", hold["target_per_s"], "req/s"),
           Figure("hold achieved rate of 200s", hold["achieved_ok_per_s"], "req/s"),
           Figure("hold duration", hold["duration_s"], "s"),
           Figure("answers not allowed", report["verdict"]["outcomes"]["bad_count"], "requests")]
    units = {"rss_mib": "MiB", "fds": "fds", "threads": "threads"}
    out += [Figure(f"{name} {metric} growth (last third - first third)", g.get("growth"), units[metric])
            for name, metrics in report["growth"].items() for metric, g in metrics.items()]
    return out
