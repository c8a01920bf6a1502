"""What a run shows: the printed table, the plot and the summary's headline figures."""

from __future__ import annotations

from pathlib import Path

from bench.common.output import pyplot, save_figure
from bench.common.record import Figure

HEADLINE = (  # (measure of ours_vs_best_peer, what it is, unit)
    ("added_c1_p50", "added latency p50 at c=1", "ms"),
    ("c32_requests_per_s", "throughput at c=32", "req/s"),
    ("cpu_us_per_request_c32", "router CPU per request at c=32", "us"),
    ("added_first_token_p50", "stream: added time to first token p50", "ms"),
)


def figures(results: dict[str, dict], comparison: dict) -> list[Figure]:
    """Per headline measure: ours, the best peer and ours / best peer (lower is better but for
    throughput); without peers, ours' added latency and throughput only."""
    ratios = comparison["ours_vs_best_peer"]
    if not ratios:
        added = comparison["added_vs_direct"].get("ours", {})
        return [Figure("ours: added latency p50 at c=1", added.get("c1_p50_ms"), "ms"),
                Figure("ours: throughput at c=32", results.get("ours", {}).get("c32", {}).get("requests_per_s"),
                       "req/s"), *_tracing_figures(comparison)]
    out = []
    for measure, what, unit in HEADLINE:
        row = ratios[measure]
        out += [Figure(f"{what}, ours", row["ours"], unit),
                Figure(f"{what}, {row['best_peer']} (best peer)", row["best_peer_value"], unit),
                Figure(f"{what}, ours / {row['best_peer']}", row["ours_over_best"], "x")]
    return out + _tracing_figures(comparison)


def _tracing_figures(comparison: dict) -> list[Figure]:
    """Tracing's cost: ours traced (at 100 % and 1 %) / ours untraced, router CPU per request at c=32
    and at c=1 (medians over rounds), where the run had the traced targets."""
    out = []
    for target, share in (("ours-traced", "100 %"), ("ours-traced-1pct", "1 %")):
        rows = comparison.get("tracing_cost", {}).get(target, {})
        for measure, what in (("c32.router_cpu_us_per_request", "c=32"), ("c1.router_cpu_us_per_request", "c=1")):
            if measure in rows:
                out.append(Figure(f"router CPU per request at {what}, traces kept at {share} / tracing off",
                                  rows[measure]["ratio"], "x"))
    return out


def print_table(results: dict[str, dict], comparison: dict) -> None:
    """Each target's numbers, then ours / the best peer on each measure."""
    added = comparison["added_vs_direct"]
    print(f"\n{'target':<14} {'c1 p50':>8} {'c1 p99':>8} {'+p50':>7} {'+p99':>7} {'c32 rps':>8} {'c32 p50':>8} "
          f"{'cpu/req c1':>10} {'cpu/req c32':>11} {'cpu/stream':>10} {'1st byte':>8} {'1st tok':>8}")
    for name, r in results.items():
        a = added.get(name, {})
        print(f"{name:<14} {r['c1']['latency_ms_p50']:>8.3f} {r['c1']['latency_ms_p99']:>8.3f} "
              f"{a.get('c1_p50_ms', 0):>7.3f} {a.get('c1_p99_ms', 0):>7.3f} {r['c32']['requests_per_s']:>8.0f} "
              f"{r['c32']['latency_ms_p50']:>8.2f} {r['c1'].get('router_cpu_us_per_request', 0):>8.0f}us "
              f"{r['c32'].get('router_cpu_us_per_request', 0):>9.0f}us {r['stream'].get('router_cpu_us_per_request', 0):>8.0f}us "
              f"{r['stream']['first_byte_ms_p50']:>8.2f} "
              f"{r['stream']['first_token_ms_p50']:>8.2f}")
    print("(ms unless marked; +p50/+p99: added over direct at c=1; 1st byte/tok: stream p50)")
    for title, key in (("ours vs ours-base", "ours_vs_base"), ("ours-epd vs ours-base-epd", "ours_epd_vs_base")):
        if comparison.get(key):
            print(f"{title} (median over rounds [min, max]; added = round p50 - direct's):")
            for measure, row in comparison[key].items():
                extra = f"  added {row['added_mine']} vs {row['added_other']}" if "added_mine" in row else ""
                print(f"  {measure}: {row['mine']} vs {row['other']} = {row['ratio']}x{extra}")
    for target, rows in comparison.get("tracing_cost", {}).items():
        print(f"{target} vs ours, tracing's cost (median over rounds [min, max]):")
        for measure, row in rows.items():
            print(f"  {measure}: {row['mine']} vs {row['other']} = {row['ratio']}x")
    for peer, rows in comparison.get("ours_vs_peer_rounds", {}).items():
        print(f"ours vs {peer} (median over rounds [min, max]):")
        for measure, row in rows.items():
            extra = f"  added {row['added_mine']} vs {row['added_other']}" if "added_mine" in row else ""
            print(f"  {measure}: {row['mine']} vs {row['other']} = {row['ratio']}x{extra}")
    for measure, row in comparison["ours_vs_best_peer"].items():
        print(f"ours / best peer ({row['best_peer']}) on {measure}: {row['ours']} vs {row['best_peer_value']} "
              f"= {row['ours_over_best']}x{'' if row['no_worse'] else '  (worse)'}")


def plot(results: dict[str, dict], comparison: dict, path: Path, title: str) -> None:
    """Added latency, throughput at c=32, router CPU per request, stream first byte/token."""
    plt = pyplot()
    names = list(results)
    routers = [n for n in names if n != "direct"]
    added = comparison["added_vs_direct"]
    fig, axes = plt.subplots(1, 4, figsize=(16, 4))
    panels = [
        ("added latency at c=1 (ms)", routers, [("p50", [added[n]["c1_p50_ms"] for n in routers]),
                                                 ("p99", [added[n]["c1_p99_ms"] for n in routers])]),
        ("throughput at c=32 (requests/s)", names, [("", [results[n]["c32"]["requests_per_s"] for n in names])]),
        ("router CPU per request (µs)", routers, [(label, [results[n][phase]["router_cpu_us_per_request"] for n in routers])
                                                 for label, phase in (("c=1", "c1"), ("c=32", "c32"),
                                                                      ("stream", "stream"))]),
        ("stream p50 (ms)", names, [("first byte", [results[n]["stream"]["first_byte_ms_p50"] for n in names]),
                                    ("first token", [results[n]["stream"]["first_token_ms_p50"] for n in names])]),
    ]
    for ax, (label, xs, series) in zip(axes, panels):
        width = 0.8 / len(series)
        for i, (name, values) in enumerate(series):
            pos = [x + (i - (len(series) - 1) / 2) * width for x in range(len(xs))]
            bars = ax.bar(pos, values, width, label=name or None)
            ax.bar_label(bars, fmt="%.3g", fontsize=7)
        ax.set_xticks(range(len(xs)), xs, fontsize=8)
        ax.set_title(label, fontsize=9)
        ax.grid(axis="y", alpha=0.3)
        if len(series) > 1:
            ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    save_figure(fig, path)
