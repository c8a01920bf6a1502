"""The printed table of a compare run, the goals, the work per core, and the same table as Markdown
(``compare.md``), and the summary's figures. Pure: from the report dict ``cli.py`` writes."""

from __future__ import annotations

from bench.common.record import Figure

COLUMNS = (("TTFT p50", "median_ttft_ms", ".0f"), ("TTFT p99", "p99_ttft_ms", ".0f"),
           ("TPOT p50", "median_tpot_ms", ".1f"), ("TPOT p99", "p99_tpot_ms", ".1f"),
           ("goodput/s", "request_goodput", ".3f"), ("E2E p50", "median_e2el_ms", ".0f"),
           ("E2E p99", "p99_e2el_ms", ".0f"))
RATIO_OF = {"median_ttft_ms": "ttft_p50", "p99_ttft_ms": "ttft_p99", "median_tpot_ms": "tpot_p50",
            "p99_tpot_ms": "tpot_p99", "request_goodput": "goodput", "median_e2el_ms": "e2e_p50",
            "p99_e2el_ms": "e2e_p99"}
CELL = 15
UNIT_KEYS = {"ms_per_image", "cpu_ms_per_image", "ms_per_1k_prompt_tokens", "cpu_ms_per_1k_prompt_tokens",
             "ms_per_step", "tokens_per_step", "cpu_ms_per_output_token", "cpu_of_busy"}


def cell(value: float | None, fmt: str, times: float | None) -> str:
    """``value`` (``n/a`` when None) and its ratio against colocated as ``(0.52x)`` when given."""
    text = "n/a" if value is None else format(value, fmt)
    return f"{text} ({times:.2f}x)" if times is not None else text


def rows(report: dict, workload: str) -> list[tuple[str, list[str], str]]:
    """(deployment, cells, good/completed/all) for one workload, colocated first."""
    out = []
    for mode, deployment in report["deployments"].items():
        result = deployment.get("workloads", {}).get(workload)
        if result is None:
            continue
        times = report["ratios"].get(mode, {}).get(workload, {})
        cells = [cell(result[key], fmt, times.get(RATIO_OF[key])) for _, key, fmt in COLUMNS]
        counts = f"{result['good_requests']}/{result['completed']}/{result['completed'] + result['failed']}"
        out.append((mode, cells, counts))
    return out


def table(report: dict) -> str:
    """Every workload's block: a header line saying what it is, then one row per deployment. Latencies
    in ms; ratios against colocated in parentheses; counts good/completed/sent."""
    slo = ", ".join(f"{k} <= {v:g}" for k, v in report["config"]["slo"].items())
    lines = [f"latencies in ms; (ratio vs colocated); goodput = requests/s meeting {slo}; counts good/ok/sent"]
    for workload in report["config"]["workloads"]:
        lines += ["", f"{workload['name']}: {workload['what']}",
                  f"{'deployment':<11}" + "".join(f"{name:>{CELL}}" for name, _, _ in COLUMNS) + f"{'good/ok/all':>14}"]
        for mode, cells, counts in rows(report, workload["name"]):
            lines.append(f"{mode:<11}" + "".join(f"{c:>{CELL}}" for c in cells) + f"{counts:>14}")
    return "\n".join(lines)


def goals_text(report: dict) -> str:
    """One block per goal: met or not, the ratio against its target, and why."""
    lines = ["goals (ratio vs colocated):"]
    for goal in report["goals"]:
        sign = "<=" if goal["goal"] != "goodput_encode_heavy" else ">="
        value = "n/a" if goal["ratio"] is None else f"{goal['ratio']:.2f}x"
        lines.append(f"  [{'met' if goal['met'] else 'NOT met'}] {goal['mode']} {goal['goal']}: {value} "
                     f"(target {sign} {goal['target']}x)")
        lines.append(f"      {goal['why']}")
    return "\n".join(lines)


def work_text(report: dict) -> str:
    """Per deployment and workload: CPU ms per completed request on each core, the capacity that gives,
    and each stage's unit costs."""
    lines = ["work per completed request (CPU ms by core, every process on it; capacity = 1000 / busiest core):"]
    for mode, by_workload in report["stage_work"].items():
        for name, work in by_workload.items():
            cores = ", ".join(f"core {core} {c['cpu_ms_per_request']} ms" for core, c in work["cores"].items())
            units = "; ".join(f"{role} " + ", ".join(f"{k} {v}" for k, v in role_work.items() if k in UNIT_KEYS)
                              for role, role_work in work["roles"].items() if UNIT_KEYS & set(role_work))
            lines.append(f"  {mode:<10} {name:<16} {cores} -> {work['capacity_rps']} req/s   [{units}]")
    return "\n".join(lines)


def markdown(report: dict) -> str:
    """The table as Markdown, one table with a workload column, and the goals as a list."""
    header = ["workload", "deployment", *(name for name, _, _ in COLUMNS), "good/ok/all"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for workload in report["config"]["workloads"]:
        for mode, cells, counts in rows(report, workload["name"]):
            lines.append("| " + " | ".join([workload["name"], mode, *cells, counts]) + " |")
    lines.append("")
    for goal in report["goals"]:
        value = "n/a" if goal["ratio"] is None else f"{goal['ratio']:.2f}x"
        sign = "<=" if goal["goal"] != "goodput_encode_heavy" else ">="
        lines.append(f"- {goal['mode']} `{goal['goal']}`: {value} (target {sign} {goal['target']}x): "
                     f"{'met' if goal['met'] else 'not met'}")
    return "\n".join(lines) + "\n"


def figures(report: dict) -> list[Figure]:
    """Each goal's ratio (the mode's value over colocated's), and per mode and workload TTFT p50 and E2E
    p50 over colocated's."""
    out = [Figure(f"{g['mode']} / colocated, {g['goal']} (goal {g['target']:g}x)", g["ratio"], "x")
           for g in report["goals"]]
    for mode, by_workload in report["ratios"].items():
        for workload, ratios in by_workload.items():
            out += [Figure(f"{mode} / colocated, {workload}: {metric}", ratios.get(metric), "x")
                    for metric in ("ttft_p50", "e2e_p50")]
    return out
