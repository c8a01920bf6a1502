"""The overload run's table, plot and summary figures."""

from __future__ import annotations

from pathlib import Path

from bench.common.output import print_header, pyplot, save_figure
from bench.common.record import Figure


def print_table(report: dict) -> None:
    """Answers per status and each process's RSS (baseline, peak, growth)."""
    outcomes, growth = report["outcomes"], report["rss"]
    print_header("status  answers  latency p50 / p90 / max (s)")
    for status, count in outcomes["by_status"].items():
        lat = outcomes["latency_s"][status]
        print(f"{status:>6}  {count:>7}  {lat.get('median')} / {lat.get('p90')} / {lat.get('max')}")
    print(f"refused by: {outcomes['refused_by']}")
    print_header("process   RSS before  peak   last   peak growth (MiB)")
    for name, g in growth.items():
        print(f"{name:<8}  {g['baseline_mib']!s:>10}  {g['peak_mib']!s:>5}  {g['last_mib']!s:>5}  "
              f"{g['peak_growth_mib']}")
    print(f"verdict: {'PASS' if report['verdict']['ok'] else 'FAIL'} {report['verdict']['reasons']}")


def plot(report: dict, path: Path, title: str) -> None:
    """RSS of each process over the run (the burst shaded), and the answers per status."""
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [3, 1]})
    samples = report["samples"]
    for name in report["rss"]:
        points = [(s["t"], s[name]["rss_mib"]) for s in samples if s.get(name)]
        ax1.plot([p[0] for p in points], [p[1] for p in points], marker=".", label=name)
    ax1.axvspan(report["burst_window_s"][0], report["burst_window_s"][1], color="orange", alpha=0.15, label="burst")
    ax1.set_xlabel("s since the first sample")
    ax1.set_ylabel("RSS (MiB)")
    ax1.legend()
    statuses = list(report["outcomes"]["by_status"].items())
    ax2.bar([s for s, _ in statuses], [n for _, n in statuses], color="tab:blue")
    ax2.set_ylabel("answers")
    ax2.set_title("answers per status")
    fig.suptitle(title)
    save_figure(fig, path)


def figures(report: dict) -> list[Figure]:
    """The summary's figures: answers per allowed status, refusals by who gave them, bad answers, the burst's wall time and each
    process's peak RSS growth."""
    outcomes = report["outcomes"]
    out = [Figure("requests", outcomes["requests"], "requests")]
    out += [Figure(f"answers {status}", outcomes["by_status"].get(status, 0), "requests")
            for status in ("200", "429", "503")]
    out += [Figure(f"refusals by the {who}", outcomes["refused_by"].get(who, 0), "requests")
            for who in ("router", "prefill", "decode")]
    out += [Figure("answers not allowed", outcomes["bad_count"], "requests"),
            Figure("burst wall time", report["burst_wall_s"], "s")]
    out += [Figure(f"{name} peak RSS growth", g["peak_growth_mib"], "MiB") for name, g in report["rss"].items()]
    return out
