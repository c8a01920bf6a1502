"""What a run shows: the ratios, the summary's figures, the printed table and the plot."""

from __future__ import annotations

from pathlib import Path

from bench.common.output import print_header, pyplot, save_figure
from bench.common.record import Figure


def ratios(on_demand: dict, reserve: dict) -> dict:
    """On demand over reserve: most requests running at once, mean running; reserve over on demand:
    the time to serve them all (above 1: on demand is faster)."""
    return {"max_running": round(on_demand["max_running"] / reserve["max_running"], 2),
            "mean_running": round(on_demand["mean_running"] / reserve["mean_running"], 2),
            "serve_time_reserve_over_on_demand": round(reserve["seconds"] / on_demand["seconds"], 2)}


def figures(on_demand: dict, reserve: dict, ratio: dict, same: bool) -> list[Figure]:
    return [Figure("most requests running at once, on demand", on_demand["max_running"], "requests"),
            Figure("most requests running at once, reserve", reserve["max_running"], "requests"),
            Figure("most running at once: on demand / reserve (goal >= 3x)", ratio["max_running"], "x"),
            Figure("time to serve them all: reserve / on demand", ratio["serve_time_reserve_over_on_demand"], "x"),
            Figure("preemptions, on demand", sum(on_demand["preemptions"].values()), "preemptions"),
            Figure("requests with the same tokens in both modes", 1.0 if same else 0.0, "all (1) / not (0)")]


def print_table(runs: list[dict], ratio: dict, same: bool) -> None:
    print_header(f"{'mode':<11}{'pool':>6}{'max run':>9}{'mean run':>10}{'steps':>7}{'seconds':>9}{'preempt':>9}"
                 f"{'preempted':>11}")
    for r in runs:
        print(f"{r['mode']:<11}{r['pool_blocks']:>6}{r['max_running']:>9}{r['mean_running']:>10}{r['steps']:>7}"
              f"{r['seconds']:>9.1f}{sum(r['preemptions'].values()):>9}{r['preempted_requests']:>11}")
    print(f"\non demand / reserve: most running {ratio['max_running']}x, mean running {ratio['mean_running']}x; "
          f"time to serve all, reserve / on demand {ratio['serve_time_reserve_over_on_demand']}x; "
          f"same tokens in both modes: {'yes' if same else 'NO'}")


def plot(runs: list[dict], path: Path, title: str) -> None:
    """Requests running per step (left) and KV blocks in use per step (right), each mode."""
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    colors = {"on_demand": "tab:blue", "reserve": "grey"}
    for r in runs:
        label = f"{r['mode']} (max {r['max_running']})"
        left.plot(r["running_per_step"], color=colors.get(r["mode"]), label=label)
        right.plot(r["blocks_per_step"], color=colors.get(r["mode"]), label=r["mode"])
    right.axhline(runs[0]["pool_blocks"], color="black", linestyle=":", label="pool")
    left.set(xlabel="engine step", ylabel="requests holding KV")
    right.set(xlabel="engine step", ylabel="KV blocks in use")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    save_figure(fig, path)
