"""What a run shows: the printed table (the one docs/admin.md "At scale" quotes) and the summary's figures."""

from __future__ import annotations

from bench.common.record import Figure


def rows(planner: dict[int, dict], hot: dict[int, dict], live: dict[int, dict], concurrency: int) -> list[list[str]]:
    """One row per fleet size: planner decision median / p99, the whole report's median, one parse,
    the pd plan (round_robin, prefix_aware), router CPU per request at c=1 and c=``concurrency`` (all,
    and less the idle rate), and the router's idle cores."""
    out = []
    for n in sorted(planner):
        p, h, lv = planner[n], hot.get(n, {}), live.get(n, {})
        phases = lv.get("phases", {})
        c1, cn = phases.get("c1", {}), phases.get(f"c{concurrency}", {})
        out.append([str(n), f"{_ms(p['decision'], 'median_us')} / {_ms(p['decision'], 'p99_us')}",
                    _ms(p["report"], "median_us"), _us(p["parse"], "median_us"),
                    f"{_us(h.get('plan_round_robin', {}), 'median_us')} / {_us(h.get('plan_prefix_aware', {}), 'median_us')}",
                    f"{_v(c1.get('cpu_ms'))} ({_v(c1.get('net_cpu_ms'))})",
                    f"{_v(cn.get('cpu_ms'))} ({_v(cn.get('net_cpu_ms'))})",
                    _v(lv.get("idle", {}).get("cores"))])
    return out


HEADER = ["N per role", "planner decision, ms (median / p99)", "whole /admin/ratio report, ms (median)",
          "parse of one scrape, us (median)", "pd plan per request, us (round_robin / prefix_aware, median)",
          "router CPU per request c=1, ms (less idle)", "router CPU per request c=C, ms (less idle)",
          "router idle CPU, cores"]


def table(planner: dict[int, dict], hot: dict[int, dict], live: dict[int, dict], concurrency: int) -> str:
    header = [h.replace("c=C", f"c={concurrency}") for h in HEADER]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows(planner, hot, live, concurrency)]
    return "\n".join(lines)


def figures(planner: dict[int, dict], hot: dict[int, dict], live: dict[int, dict], concurrency: int) -> list[Figure]:
    out = []
    for n in sorted(planner):
        p, h, lv = planner[n], hot.get(n, {}), live.get(n, {})
        out += [Figure(f"N={n}: planner decision median", _num(p["decision"].get("median_us"), 1e-3), "ms"),
                Figure(f"N={n}: planner decision p99", _num(p["decision"].get("p99_us"), 1e-3), "ms"),
                Figure(f"N={n}: parse of one scrape median", p["parse"].get("median_us"), "us"),
                Figure(f"N={n}: pd plan (round_robin) median", h.get("plan_round_robin", {}).get("median_us"), "us")]
        if lv:
            cn = lv.get("phases", {}).get(f"c{concurrency}", {})
            out += [Figure(f"N={n}: router CPU per request c={concurrency}", cn.get("cpu_ms"), "ms"),
                    Figure(f"N={n}: router idle CPU", lv.get("idle", {}).get("cores"), "cores")]
    return out


def _num(value: float | None, scale: float) -> float | None:
    return None if value is None else round(value * scale, 4)


def _ms(stats: dict, key: str) -> str:
    value = stats.get(key)
    return "n/a" if value is None else f"{value / 1000:.3g}"


def _us(stats: dict, key: str) -> str:
    value = stats.get(key)
    return "n/a" if value is None else f"{value:.3g}"


def _v(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3g}"
