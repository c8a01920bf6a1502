"""One deployment's rounds of one workload, pooled into one result. Pure.

The deployments run one after the other, and the load other processes put on the machine drifts over
the minutes of a run; so the whole sequence runs ``--rounds`` times (reversed every other round), and
each deployment's samples of a workload are pooled: percentiles over every request of every round,
goodput over the sum of the rounds' durations, the probes' deltas added. ``per_round`` keeps each
round's headline numbers to show the drift.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from bench.serve import metrics
from bench.serve.client import Outcome
from bench.serve.config import Slo
from bench.serve.tokens import Counts
from bench.serve.workload import Request, summarize

PER_ROUND_KEYS = ("duration", "completed", "failed", "good_requests", "median_ttft_ms", "p99_tpot_ms",
                  "median_e2el_ms", "request_goodput")


@dataclass(frozen=True)
class Measured:
    """One round of one workload on one deployment: what the client saw, the token counts, the run's
    duration and client CPU seconds, and the probe (``probe.Probe.done``)."""

    outcomes: list[Outcome]
    counts: Counts
    duration: float
    client_cpu_s: float
    probe: dict


def pooled(rounds: list[Measured], slo: Slo, requests: list[Request]) -> tuple[dict, dict[str, list[float]]]:
    """The pooled result (``bench.serve`` keys, plus ``rounds``, ``per_round``, ``client_cpu_s``,
    ``workload`` and the summed ``probe``) and the pooled latency samples (seconds, for plots)."""
    outcomes = [o for r in rounds for o in r.outcomes]
    counts = Counts([t for r in rounds for t in r.counts.input_tokens],
                    [t for r in rounds for t in r.counts.output_tokens], _sources(r.counts.sources for r in rounds))
    duration = sum(r.duration for r in rounds)
    per_round = []
    for r in rounds:
        alone = metrics.summarize(r.outcomes, r.counts, r.duration, slo)
        per_round.append({key: alone[key] for key in PER_ROUND_KEYS})
    result = {**metrics.summarize(outcomes, counts, duration, slo), "rounds": len(rounds), "per_round": per_round,
              "client_cpu_s": round(sum(r.client_cpu_s for r in rounds), 3), "workload": summarize(requests),
              "probe": merge_probes([r.probe for r in rounds])}
    return result, metrics.per_request(outcomes, counts)


def merge_probes(probes: list[dict]) -> dict:
    """Probes of several rounds as one: each role's CPU seconds and series added; the machine's wall and
    client CPU seconds added, and each round's machine meters kept under ``machine.rounds``."""
    roles: dict[str, dict] = {}
    for probe in probes:
        for role, got in probe["roles"].items():
            into = roles.setdefault(role, {})
            if "cpu_s" in got:
                into["cpu_s"] = round(into.get("cpu_s", 0.0) + got["cpu_s"], 3)
            if "series" in got:
                series = into.setdefault("series", {})
                for key, value in got["series"].items():
                    series[key] = round(series.get(key, 0.0) + value, 6)
    machine = {"wall_s": round(sum(p["machine"]["wall_s"] for p in probes), 2),
               "client_cpu_s": round(sum(p["machine"]["client_cpu_s"] for p in probes), 2),
               "rounds": [p["machine"] for p in probes]}
    return {"machine": machine, "roles": roles}


def _sources(each) -> dict[str, dict[str, int]]:
    total: dict[str, Counter] = {"input": Counter(), "output": Counter()}
    for sources in each:
        for side, counted in sources.items():
            total.setdefault(side, Counter()).update(counted)
    return {side: dict(counter) for side, counter in total.items()}
