"""The numbers of a run, from the rounds' raw samples: pooled per target (``summarize``), the stage
check (``check_stage_reach``), the added latency over direct and ours / the best peer on each measure
(``compare``: the ratios bench/README.md quotes). Pure; tested in tests/bench/test_router_overhead.py."""

from __future__ import annotations

from bench.common.stats import percentile
from bench.router_overhead.peers import PEERS, TRACED

PHASES = ("c1", "stream", "c32")
STAGE_CALLS = ("prefill_requests", "decode_requests")  # the fake pair's /bench/stats counters


def summarize(target: str, rounds: list[dict]) -> dict:
    """Pool the rounds of one target into the reported numbers (ms, µs, requests/s)."""
    out: dict = {"target": target}
    for phase in PHASES:
        samples = [s for r in rounds for s in r[phase]["samples"]]
        wall = sum(r[phase]["wall_s"] for r in rounds)
        cpu = [r[phase]["router_cpu_s"] for r in rounds]
        lat = [1000 * s.latency_s for s in samples]
        row = {"requests": len(samples), "errors": sum(len(r[phase]["errors"]) for r in rounds),
               "first_errors": [e for r in rounds for e in r[phase]["errors"]][:3],
               "latency_ms_p50": round(percentile(lat, 0.5), 3), "latency_ms_p99": round(percentile(lat, 0.99), 3),
               "latency_ms_mean": round(sum(lat) / len(lat), 3), "wall_s": round(wall, 2),
               "requests_per_s": round(len(samples) / wall, 1),
               "backend_calls": {k: sum(r[phase]["reached"][k] for r in rounds) for k in STAGE_CALLS}}
        if None not in cpu:
            row["router_cpu_us_per_request"] = round(1e6 * sum(cpu) / max(1, len(samples)), 1)
            row["router_cpu_us_per_request_best_round"] = round(min(  # the round least disturbed by other load
                1e6 * r[phase]["router_cpu_s"] / max(1, len(r[phase]["samples"])) for r in rounds), 1)
            row["router_cpu_share"] = round(sum(cpu) / wall, 3)
        row["per_round"] = _per_round(rounds, phase)
        if phase == "stream":
            fb = [1000 * s.first_byte_s for s in samples]
            ft = [1000 * s.first_token_s for s in samples]
            row |= {"first_byte_ms_p50": round(percentile(fb, 0.5), 3), "first_byte_ms_p99": round(percentile(fb, 0.99), 3),
                    "first_token_ms_p50": round(percentile(ft, 0.5), 3),
                    "first_token_ms_p99": round(percentile(ft, 0.99), 3)}
        out[phase] = row
    return out


def _per_round(rounds: list[dict], phase: str) -> dict:
    """Each round's p50 latency, requests/s, CPU per request (and a stream's first byte and token p50),
    with their median and spread (min, max) over the rounds: ``{measure: {"rounds", "median", "min", "max"}}``."""
    values: dict[str, list[float]] = {"latency_ms_p50": [], "requests_per_s": [], "router_cpu_us_per_request": [],
                                      "first_byte_ms_p50": [], "first_token_ms_p50": []}
    for r in rounds:
        samples = r[phase]["samples"]
        if not samples:
            continue
        values["latency_ms_p50"].append(percentile([1000 * s.latency_s for s in samples], 0.5))
        values["requests_per_s"].append(len(samples) / r[phase]["wall_s"])
        if r[phase]["router_cpu_s"] is not None:
            values["router_cpu_us_per_request"].append(1e6 * r[phase]["router_cpu_s"] / len(samples))
        if phase == "stream":
            values["first_byte_ms_p50"].append(percentile([1000 * s.first_byte_s for s in samples], 0.5))
            values["first_token_ms_p50"].append(percentile([1000 * s.first_token_s for s in samples], 0.5))
    return {k: {"rounds": [round(x, 3) for x in v], "median": round(percentile(v, 0.5), 3), "min": round(min(v), 3),
                "max": round(max(v), 3)} for k, v in values.items() if v}


def versus(results: dict[str, dict], mine: str, other: str) -> dict:
    """``mine`` / ``other`` (e.g. ours / ours-base, two commits side by side) on the medians over rounds:
    ``{measure: {"mine": [median, min, max], "other": [...], "ratio": median / median}}``; added
    latency is each round's p50 less direct's p50 of the same round."""
    out: dict = {}
    direct = results.get("direct")
    for phase, measure in (("c1", "latency_ms_p50"), ("c1", "router_cpu_us_per_request"),
                           ("c32", "requests_per_s"), ("c32", "router_cpu_us_per_request"),
                           ("c32", "latency_ms_p50"), ("stream", "router_cpu_us_per_request"),
                           ("stream", "first_byte_ms_p50"), ("stream", "first_token_ms_p50")):
        a, b = results[mine][phase]["per_round"].get(measure), results[other][phase]["per_round"].get(measure)
        if not a or not b:
            continue
        row = {"mine": [a["median"], a["min"], a["max"]], "other": [b["median"], b["min"], b["max"]],
               "ratio": round(a["median"] / b["median"], 3) if b["median"] else None}
        if direct and measure in ("latency_ms_p50", "first_byte_ms_p50", "first_token_ms_p50") and phase != "c32":
            base = direct[phase]["per_round"][measure]["rounds"]
            added = {n: [x - y for x, y in zip(results[n][phase]["per_round"][measure]["rounds"], base)]
                     for n in (mine, other)}
            row["added_mine"] = [round(percentile(added[mine], 0.5), 3), round(min(added[mine]), 3),
                                 round(max(added[mine]), 3)]
            row["added_other"] = [round(percentile(added[other], 0.5), 3), round(min(added[other]), 3),
                                  round(max(added[other]), 3)]
        out[f"{phase}.{measure}"] = row
    return out


def compare(results: dict[str, dict]) -> dict:
    """Added latency vs direct per router, and ours / the best peer on each measure."""
    direct = results.get("direct")
    added = {}
    for name, r in results.items():
        if name == "direct" or not direct:
            continue
        added[name] = {
            "c1_p50_ms": round(r["c1"]["latency_ms_p50"] - direct["c1"]["latency_ms_p50"], 3),
            "c1_p99_ms": round(r["c1"]["latency_ms_p99"] - direct["c1"]["latency_ms_p99"], 3),
            "first_byte_p50_ms": round(r["stream"]["first_byte_ms_p50"] - direct["stream"]["first_byte_ms_p50"], 3),
            "first_token_p50_ms": round(r["stream"]["first_token_ms_p50"] - direct["stream"]["first_token_ms_p50"], 3),
        }
    peers = [p for p in PEERS if p in results]
    ratios: dict = {}
    if "ours" in results and peers:
        measures = {  # name: (value of a result, lower is better)
            "added_c1_p50": (lambda n: added[n]["c1_p50_ms"], True),
            "added_c1_p99": (lambda n: added[n]["c1_p99_ms"], True),
            "c32_requests_per_s": (lambda n: results[n]["c32"]["requests_per_s"], False),
            "cpu_us_per_request_c1": (lambda n: results[n]["c1"].get("router_cpu_us_per_request"), True),
            "cpu_us_per_request_c32": (lambda n: results[n]["c32"].get("router_cpu_us_per_request"), True),
            "cpu_us_per_request_stream": (lambda n: results[n]["stream"].get("router_cpu_us_per_request"), True),
            "cpu_us_per_request_c32_best_round": (
                lambda n: results[n]["c32"].get("router_cpu_us_per_request_best_round"), True),
            "added_first_byte_p50": (lambda n: added[n]["first_byte_p50_ms"], True),
            "added_first_token_p50": (lambda n: added[n]["first_token_p50_ms"], True),
        }
        for measure, (value, lower) in measures.items():
            best = (min if lower else max)(peers, key=value)
            mine, theirs = value("ours"), value(best)
            ratios[measure] = {"ours": mine, "best_peer": best, "best_peer_value": theirs,
                               "ours_over_best": round(mine / theirs, 2) if theirs else None,
                               "no_worse": mine <= theirs if lower else mine >= theirs}
    out = {"added_vs_direct": added, "ours_vs_best_peer": ratios}
    if "ours" in results and "ours-base" in results:
        out["ours_vs_base"] = versus(results, "ours", "ours-base")
    if "ours-epd" in results and "ours-base-epd" in results:
        out["ours_epd_vs_base"] = versus(results, "ours-epd", "ours-base-epd")
    for peer in peers:
        if "ours" in results:
            out.setdefault("ours_vs_peer_rounds", {})[peer] = versus(results, "ours", peer)
    out["tracing_cost"] = {traced: versus(results, traced, "ours") for traced in TRACED
                           if traced in results and "ours" in results}
    return out


def failed_targets(runs: dict[str, list[dict]]) -> dict[str, list[str]]:
    """The targets with a phase in which no answer was right, with their first five errors."""
    return {t: [e for r in rounds for phase in r.values() for e in phase["errors"]][:5]
            for t, rounds in runs.items() if any(not phase["samples"] for r in rounds for phase in r.values())}


def check_stage_reach(results: dict[str, dict]) -> list[str]:
    """Set ``each_stage_reached_once`` on every target's phase: the fake prefill and decode each
    counted exactly one call per request sent (answered or not). Returns a line per phase where that
    is false, naming the target, the phase and the counts."""
    wrong = []
    for target, result in results.items():
        for phase in PHASES:
            row = result[phase]
            sent, calls = row["requests"] + row["errors"], row["backend_calls"]
            row["each_stage_reached_once"] = calls["prefill_requests"] == calls["decode_requests"] == sent
            if not row["each_stage_reached_once"]:
                wrong.append(f"{target} {phase}: {sent} requests, the prefill got {calls['prefill_requests']} "
                             f"and the decode {calls['decode_requests']}")
    return wrong
