"""The table, the plot (split and TTFT over time per configuration) and the summary's figures."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from bench.common.output import print_header, pyplot, save_figure
from bench.common.record import Figure
from bench.ratio_shift.analysis import ROLES, split_of
from bench.ratio_shift.workload import Phase

COLOURS = {"encoder": "tab:green", "prefill": "tab:blue", "decode": "tab:orange"}


def print_table(summary: dict, phases: Sequence[Phase]) -> None:
    if "configs" not in summary:
        print(f"no table: {summary.get('error')}")
        return
    slo = summary["slo"]
    print(f"\nSLO: TTFT <= {slo['ttft_s'] * 1000:.0f} ms and TPOT <= {slo['tpot_s'] * 1000:.1f} ms "
          f"({slo['factor']:g}x the medians of {summary['slo_source']}); best fixed: {summary['best_fixed']}")
    names = [p.name for p in phases]
    print_header(f"{'configuration':<16}" + "".join(f"{n + ' good/s':>16}" for n in [*names, "overall"])
                 + f"{'vs best fixed':>14}{'answered/s':>11}{'failed':>7}{'in switch':>10}  re-balance first/last s")
    for name, c in summary["configs"].items():
        rebalance = ", ".join(f"{p}: {v['first_s']}/{v['last_s']}" for p, v in c["rebalance_s"].items())
        print(f"{name:<16}" + "".join(f"{c['goodput'][n]:>16.3f}" for n in [*names, "overall"])
              + f"{c['vs_best_fixed']['overall'] or 0:>13.3f}x{c['throughput']:>11.3f}{c['failed']:>7}"
              + f"{c['during_switch']:>10}  {rebalance}")
    print_header(f"{'configuration':<16}" + "".join(f"{n + ' TTFT p50 ms':>20}" for n in names) + f"{'TPOT p50 ms':>13}")
    for name, c in summary["configs"].items():
        print(f"{name:<16}" + "".join(f"{(c['ttft_median_s'][n] or 0) * 1000:>20.0f}" for n in names)
              + f"{(c['tpot_median_s'] or 0) * 1000:>13.1f}")


def plot(runs: dict[str, dict], phases: Sequence[Phase], summary: dict, path: Path, title: str) -> None:
    """Per configuration two rows: workers per role over time, and each request's TTFT at its send time
    (failed ones marked x), the SLO dashed, phase boundaries dotted."""
    plt = pyplot()
    fig, axes = plt.subplots(2, len(runs), figsize=(4.2 * len(runs), 6.5), sharex=True, squeeze=False)
    slo = summary.get("slo") or {}
    for col, (name, run) in enumerate(runs.items()):
        top, bottom = axes[0][col], axes[1][col]
        samples = [s for s in run["samples"] if s.get("workers")]
        times = [s["t_s"] for s in samples]
        for offset, role in zip((0.06, 0.0, -0.06), ROLES):  # offset so that equal counts stay visible
            top.step(times, [split_of(s)[role] + offset for s in samples], where="post", label=role,
                     color=COLOURS[role])
        top.set_title(name, fontsize=9)
        top.set_ylim(-0.2, max(3, max((max(split_of(s).values()) for s in samples), default=3)) + 0.3)
        ok = [r for r in run["requests"] if r["ok"]]
        for kind, marker in (("images", "o"), ("text", "s")):
            picked = [r for r in ok if r["kind"] == kind]
            bottom.scatter([r["send_s"] for r in picked], [r["ttft_s"] for r in picked], s=6, marker=marker, label=kind)
        bad = [r for r in run["requests"] if not r["ok"]]
        bottom.scatter([r["send_s"] for r in bad], [0] * len(bad), marker="x", color="red", label="failed")
        if slo:
            bottom.axhline(slo["ttft_s"], linestyle="--", color="grey", linewidth=0.8)
        for ax in (top, bottom):
            for p in phases[1:]:
                ax.axvline(p.start_s, linestyle=":", color="black", linewidth=0.8)
        bottom.set_xlabel("seconds")
    axes[0][0].set_ylabel("workers")
    axes[1][0].set_ylabel("TTFT (s)")
    axes[0][0].legend(fontsize=7)
    axes[1][0].legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    save_figure(fig, path)


def figures(summary: dict, phases: Sequence[Phase], judged: Sequence[str]) -> list[Figure]:
    """The summary's figures: the SLO; each configuration's overall goodput, and for the auto ones its
    ratio over the best fixed split; the goodput per phase and the re-balance times (last change) of
    the best fixed split and the ``judged`` ones; the requests failed in all configurations."""
    configs = summary.get("configs")
    if not configs:
        return []
    best = summary["best_fixed"]
    out = [Figure("SLO TTFT", round(summary["slo"]["ttft_s"] * 1000, 1), "ms"),
           Figure("SLO TPOT", round(summary["slo"]["tpot_s"] * 1000, 2), "ms")]
    for name, c in configs.items():
        out.append(Figure(f"{name} goodput overall", c["goodput"]["overall"], "req/s"))
        if not name.startswith("fixed-"):
            out.append(Figure(f"{name} goodput overall / best fixed ({best})", c["vs_best_fixed"]["overall"], "x"))
    for name in [best, *(n for n in judged if n in configs)]:
        out += [Figure(f"{name} goodput {p.name}", configs[name]["goodput"][p.name], "req/s") for p in phases]
    for name in (n for n in judged if n in configs):
        out += [Figure(f"{name} re-balance after the shift to {p} (last change)", v["last_s"], "s")
                for p, v in configs[name]["rebalance_s"].items()]
    out.append(Figure("requests failed, all configurations", sum(c["failed"] for c in configs.values()), "requests"))
    return out
