"""What a run shows: the printed tables, the plot and the summary's headline figures."""

from __future__ import annotations

from pathlib import Path

from bench.chunked_prefill.analysis import BASELINE, CHUNKED, GOAL_RATIO
from bench.common.output import print_header, pyplot, save_figure
from bench.common.record import Figure


def figures(phases: dict[str, dict], by_phase: dict[str, dict], costs: list[dict],
            replayed: dict[str, dict]) -> list[Figure]:
    """TPOT p99 of each phase, each phase's TPOT p99 and ITL p99 over the baseline (the goal's first),
    the lone long prompt's TTFT per server and over the unchunked one's, the same ratios replayed on
    the engine's CPU clock, then the engine's step costs."""
    out = [Figure(f"TPOT p99, {name} ({_budget(p)})", p["load"]["p99_tpot_ms"], "ms") for name, p in phases.items()]
    ordered = sorted(by_phase, key=lambda name: name != CHUNKED)
    for name in ordered:
        goal = f" (goal {GOAL_RATIO:g}x)" if name == CHUNKED else ""
        out.append(Figure(f"TPOT p99 {name} / {BASELINE}{goal}", by_phase[name]["tpot_p99"], "x"))
        out.append(Figure(f"ITL p99 {name} / {BASELINE}", by_phase[name]["itl_p99"], "x"))
    for name, p in phases.items():
        if p.get("lone"):
            out.append(Figure(f"lone long prompt TTFT p50, {name} ({_budget(p)})", p["lone"]["ttft_ms_median"], "ms"))
    out += [Figure(f"lone long prompt TTFT {name} / unchunked", by_phase[name]["lone_ttft_vs_unchunked"], "x")
            for name in ordered if name != "unchunked" and by_phase[name]["lone_ttft_vs_unchunked"] is not None]
    for name in sorted(replayed, key=lambda name: name != CHUNKED):
        out.append(Figure(f"replay (engine CPU clock): TPOT p99 {name} / {BASELINE}", replayed[name]["tpot_p99"], "x"))
        out.append(Figure(f"replay (engine CPU clock): ITL p99 {name} / {BASELINE}", replayed[name]["itl_p99"], "x"))
    for row in costs:
        out.append(Figure(f"engine, budget {row['budget']}: step with a chunk / decode step", row["chunk_over_decode"], "x"))
        out.append(Figure(f"engine, budget {row['budget']}: long prompt prefill", row["prefill_ms"], "ms"))
    return out


def _budget(phase: dict) -> str:
    return f"budget {phase['budget']}"


def print_tables(phases: dict[str, dict], by_phase: dict[str, dict], costs: list[dict], period_s: float,
                 replayed: dict[str, dict], replay_ratios: dict[str, dict]) -> None:
    """Per phase: budget, requests, TPOT and ITL percentiles with the ratios, arrivals and their TTFT
    (a warning where their median exceeds ``period_s``: the server fell behind), the lone prompt's TTFT;
    then the engine's step costs by budget."""
    print_header(f"{'phase':<13}{'budget':>7}{'reqs':>6}{'TPOT p50':>9}{'p99':>8}{'/alone':>8}{'ITL p99':>9}"
                 f"{'/alone':>8}{'ITL max':>9}{'arrivals':>9}{'arr TTFT p50':>13}{'lone TTFT':>10}{'/unch':>7}")
    for name, p in phases.items():
        load, r = p["load"], by_phase.get(name, {})
        lone = p.get("lone") or {}
        print(f"{name:<13}{p['budget']:>7}{load['stream_requests']:>6}{_ms(load['median_tpot_ms']):>9}"
              f"{_ms(load['p99_tpot_ms']):>8}{_x(r.get('tpot_p99')):>8}{_ms(load['p99_itl_ms']):>9}{_x(r.get('itl_p99')):>8}"
              f"{_ms(load['max_itl_ms']):>9}{load['arrivals']:>9}{_ms(load['median_arrival_ttft_ms']):>13}"
              f"{_ms(lone.get('ttft_ms_median')):>10}{_x(r.get('lone_ttft_vs_unchunked')):>7}")
    print("ms; TPOT per request (e2el - ttft) / (tokens - 1), p99 over requests; ITL every gap, pooled; "
          "lone TTFT: one long prompt alone on that server")
    for name, p in phases.items():
        if (p["load"]["median_arrival_ttft_ms"] or 0) > 1e3 * period_s:
            print(f"warning: {name}: the long prompts' TTFT p50 exceeds the {period_s:g} s period: the server fell "
                  "behind the arrivals (outside load on its core, or a budget it cannot sustain); its figures measure "
                  "a queue")
    if replayed:
        print_header(f"{'replay':<13}{'budget':>7}{'reqs':>6}{'TPOT p50':>9}{'p99':>8}{'/alone':>8}{'ITL p99':>9}"
                     f"{'/alone':>8}{'ITL max':>9}{'arrivals':>9}{'arr TTFT p50':>13}")
        for name, p in replayed.items():
            r = replay_ratios.get(name, {})
            print(f"{name:<13}{p['budget']:>7}{p['stream_requests']:>6}{_ms(p['median_tpot_ms']):>9}{_ms(p['p99_tpot_ms']):>8}"
                  f"{_x(r.get('tpot_p99')):>8}{_ms(p['p99_itl_ms']):>9}{_x(r.get('itl_p99')):>8}{_ms(p['max_itl_ms']):>9}"
                  f"{p['arrivals']:>9}{_ms(p['median_arrival_ttft_ms']):>13}")
        print("the same phases on the engine alone, timed on its thread's CPU clock (no HTTP; outside load does not count)")
    if costs:
        print_header(f"{'budget':>7}{'decode step':>12}{'chunk step':>11}{'/decode':>8}{'max':>8}{'steps':>6}"
                     f"{'prefill':>9}{'/unch':>7}{'CPU: /decode':>13}{'prefill':>9}{'/unch':>7}")
        largest = max(costs, key=lambda row: row["budget"])
        whole, whole_cpu = largest["prefill_ms"], largest["prefill_cpu_ms"]
        for row in costs:
            print(f"{row['budget']:>7}{row['decode_step_ms']:>12.1f}{row['chunk_step_ms']:>11.1f}"
                  f"{_x(row['chunk_over_decode']):>8}{row['chunk_step_max_ms']:>8.0f}{row['chunk_steps']:>6}"
                  f"{row['prefill_ms']:>9.0f}{_x(round(row['prefill_ms'] / whole, 2)):>7}"
                  f"{_x(row['chunk_over_decode_cpu']):>13}{row['prefill_cpu_ms']:>9.0f}"
                  f"{_x(round(row['prefill_cpu_ms'] / whole_cpu, 2)):>7}")
        print(f"engine alone, ms: a step of {costs[0]['streams']} decodes, and of those decodes beside a chunk of "
              f"budget - {costs[0]['streams']} prompt tokens (median; max), until the {costs[0]['prompt_tokens']}-token "
              "prompt is done (steps, prefill = their sum; /unch over the largest budget's); CPU: the same in the "
              "engine thread's CPU time")


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def plot(phases: dict[str, dict], by_phase: dict[str, dict], costs: list[dict], replayed: dict[str, dict],
         path: Path, title: str) -> None:
    """Left: TPOT p99 and ITL p99 per phase (ratios to the baseline); then the same ratios replayed on the
    engine's CPU clock; the lone long prompt's TTFT per server; the engine's step with a chunk, and the
    decode step, by budget."""
    plt = pyplot()
    fig, (left, replay, middle, right) = plt.subplots(1, 4, figsize=(18, 4.4))
    names = list(replayed)
    for offset, key, label in ((-0.2, "tpot_p99", "TPOT p99 / alone"), (0.2, "itl_p99", "ITL p99 / alone")):
        bars = replay.bar([i + offset for i in range(len(names))], [replayed[n][key] or 0 for n in names], 0.4, label=label)
        for bar in bars:
            replay.text(bar.get_x() + bar.get_width() / 2, bar.get_height(), f"{bar.get_height():.1f}x", ha="center",
                        va="bottom", fontsize=7)
    replay.axhline(GOAL_RATIO, color="red", ls="--", lw=0.8, label=f"goal {GOAL_RATIO:g}x")
    replay.set_xticks(range(len(names)), names, fontsize=7)
    replay.set_yscale("log")
    replay.legend(fontsize=7)
    replay.set_title("replayed on the engine's CPU clock: / alone", fontsize=9)
    names = list(phases)
    for offset, key, ratio_key, label in ((-0.2, "p99_tpot_ms", "tpot_p99", "TPOT p99"),
                                          (0.2, "p99_itl_ms", "itl_p99", "ITL p99")):
        values = [phases[n]["load"][key] or 0 for n in names]
        bars = left.bar([i + offset for i in range(len(names))], values, 0.4, label=label)
        for bar, name in zip(bars, names):
            r = by_phase.get(name, {}).get(ratio_key)
            if r is not None:
                left.text(bar.get_x() + bar.get_width() / 2, bar.get_height(), f"{r:.1f}x", ha="center", va="bottom",
                          fontsize=7)
    left.axhline((phases[BASELINE]["load"]["p99_tpot_ms"] or 0) * GOAL_RATIO, color="red", ls="--", lw=0.8,
                 label=f"goal: {GOAL_RATIO:g}x TPOT p99 alone")
    left.set_xticks(range(len(names)), [f"{n}\n{phases[n]['budget']}" for n in names], fontsize=7)
    left.set_ylabel("ms")
    left.set_yscale("log")
    left.legend(fontsize=7)
    left.set_title("8 streams: TPOT p99 and ITL p99", fontsize=9)
    lone = [n for n in names if phases[n].get("lone")]
    middle.bar(range(len(lone)), [phases[n]["lone"]["ttft_ms_median"] or 0 for n in lone], 0.6, color="grey")
    middle.set_xticks(range(len(lone)), [f"{n}\n{phases[n]['budget']}" for n in lone], fontsize=7)
    middle.set_ylabel("ms")
    middle.set_title("one long prompt alone: TTFT p50", fontsize=9)
    if costs:
        budgets = [row["budget"] for row in costs]
        right.plot(budgets, [row["chunk_step_ms"] for row in costs], "o-", label="step: decodes + chunk")
        right.plot(budgets, [row["decode_step_ms"] for row in costs], "s--", label="step: decodes only")
        right.plot(budgets, [row["prefill_ms"] for row in costs], "^:", label="whole long prompt (sum of steps)")
        right.set_xscale("log", base=2)
        right.set_yscale("log")
        right.set_xlabel("--max-batched-tokens")
        right.set_ylabel("ms")
        right.legend(fontsize=7)
        right.set_title("engine alone: what a step costs", fontsize=9)
    for ax in (left, replay, middle, right):
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=9)
    save_figure(fig, path)
