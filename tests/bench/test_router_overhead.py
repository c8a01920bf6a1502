"""The pure parts of bench/router_overhead/: pooling a target's rounds, the added latency over direct
and ours / the best peer (the ratios bench/README.md quotes), the check that every router reached
the prefill and the decode once per request (a failing check fails the run), and the summary's figures."""

from __future__ import annotations

import pytest

from bench.router_overhead.analysis import check_stage_reach, compare, failed_targets, summarize
from bench.router_overhead.client import Sample
from bench.router_overhead.report import figures

pytestmark = pytest.mark.unit


def phase(latencies_ms, wall_s=1.0, cpu_s=0.01, errors=(), reached=None, first_ms=None):
    samples = [Sample(ms / 1e3, *( (first_ms / 1e3, first_ms / 1e3) if first_ms else ())) for ms in latencies_ms]
    n = len(samples) + len(errors)
    return {"samples": samples, "wall_s": wall_s, "router_cpu_s": cpu_s, "errors": list(errors),
            "reached": reached or {"prefill_requests": n, "decode_requests": n}, "sent": n}


def rounds(c1_ms, c32_rps, cpu_us, first_ms, n_rounds=1):
    """``n_rounds`` identical rounds: 10 c=1 requests at ``c1_ms``, a stream phase whose first token
    comes at ``first_ms``, and ``c32_rps`` requests answered in one second at c=32, each costing
    ``cpu_us`` of router CPU."""
    one = {"c1": phase([c1_ms] * 10, cpu_s=10 * cpu_us / 1e6),
           "stream": phase([first_ms + 16] * 4, cpu_s=4 * cpu_us / 1e6, first_ms=first_ms),
           "c32": phase([5.0] * c32_rps, wall_s=1.0, cpu_s=c32_rps * cpu_us / 1e6)}
    return [one] * n_rounds


def results(**targets):
    return {name: summarize(name, r) for name, r in targets.items()}


def test_summarize_pools_rounds_into_latency_throughput_and_cpu_per_request():
    row = summarize("ours", rounds(1.0, 400, 250.0, 2.0, n_rounds=2))
    assert (row["c1"]["requests"], row["c1"]["latency_ms_p50"], row["c1"]["errors"]) == (20, 1.0, 0)
    assert row["c32"]["requests_per_s"] == 400.0 and row["c32"]["wall_s"] == 2.0
    assert row["c32"]["router_cpu_us_per_request"] == 250.0 == row["c32"]["router_cpu_us_per_request_best_round"]
    assert row["c32"]["router_cpu_share"] == 0.1
    assert (row["stream"]["first_token_ms_p50"], row["stream"]["first_byte_ms_p50"]) == (2.0, 2.0)
    assert row["c1"]["backend_calls"] == {"prefill_requests": 20, "decode_requests": 20}


def test_ours_over_the_best_peer_picks_the_best_peer_per_measure():
    out = compare(results(direct=rounds(0.4, 1000, 0.0, 0.5), ours=rounds(1.0, 400, 250.0, 1.5),
                          **{"sglang-router": rounds(0.6, 800, 100.0, 0.9),
                             "vllm-router": rounds(0.5, 500, 200.0, 1.0)}))
    assert out["added_vs_direct"]["ours"]["c1_p50_ms"] == 0.6
    assert out["added_vs_direct"]["vllm-router"]["first_token_p50_ms"] == 0.5
    ratios = out["ours_vs_best_peer"]
    assert ratios["added_c1_p50"] == {"ours": 0.6, "best_peer": "vllm-router", "best_peer_value": 0.1,
                                      "ours_over_best": 6.0, "no_worse": False}
    assert ratios["c32_requests_per_s"]["best_peer"] == "sglang-router"  # higher is better
    assert ratios["c32_requests_per_s"]["ours_over_best"] == 0.5
    assert (ratios["cpu_us_per_request_c32"]["best_peer"], ratios["cpu_us_per_request_c32"]["ours_over_best"]) == \
        ("sglang-router", 2.5)
    assert (ratios["added_first_token_p50"]["best_peer"], ratios["added_first_token_p50"]["ours_over_best"]) == \
        ("sglang-router", 2.5)  # added 1.0 vs 0.4 ms


def test_ours_no_worse_than_a_peer_and_a_run_without_peers():
    out = compare(results(direct=rounds(0.4, 1000, 0.0, 0.5), ours=rounds(0.5, 900, 80.0, 0.6),
                          **{"sglang-router": rounds(0.6, 800, 100.0, 0.9)}))
    assert all(row["no_worse"] for row in out["ours_vs_best_peer"].values())
    alone = compare(results(direct=rounds(0.4, 1000, 0.0, 0.5), ours=rounds(0.5, 900, 80.0, 0.6)))
    assert alone["ours_vs_best_peer"] == {} and alone["added_vs_direct"]["ours"]["c1_p50_ms"] == 0.1


def test_the_stage_check_passes_when_each_stage_got_one_call_per_request():
    res = results(ours=rounds(1.0, 40, 250.0, 2.0))
    assert check_stage_reach(res) == []
    assert all(res["ours"][p]["each_stage_reached_once"] for p in ("c1", "stream", "c32"))


@pytest.mark.parametrize("reached, line", [
    ({"prefill_requests": 10, "decode_requests": 9}, "ours c1: 10 requests, the prefill got 10 and the decode 9"),
    ({"prefill_requests": 20, "decode_requests": 20}, "ours c1: 10 requests, the prefill got 20 and the decode 20"),
])
def test_the_stage_check_names_each_phase_that_missed_or_doubled_a_stage(reached, line):
    r = rounds(1.0, 40, 250.0, 2.0)
    r = [{**r[0], "c1": {**r[0]["c1"], "reached": reached}}]
    res = results(ours=r)
    assert check_stage_reach(res) == [line]
    assert res["ours"]["c1"]["each_stage_reached_once"] is False and res["ours"]["c32"]["each_stage_reached_once"]


def test_a_failed_request_still_counts_as_sent_for_the_stage_check():
    r = rounds(1.0, 40, 250.0, 2.0)
    r = [{**r[0], "c1": phase([1.0] * 9, errors=["HTTP 502: 'x'"])}]
    assert check_stage_reach(results(ours=r)) == []


def test_failed_targets_are_those_with_a_phase_without_a_right_answer():
    good = rounds(1.0, 40, 250.0, 2.0)
    bad = [{**good[0], "stream": phase([], errors=[f"HTTP 500: '{i}'" for i in range(7)])}]
    assert failed_targets({"ours": good, "vllm-router": bad}) == {"vllm-router": [f"HTTP 500: '{i}'" for i in range(5)]}


def test_figures_give_ours_the_best_peer_and_the_ratio_per_headline_measure():
    res = results(direct=rounds(0.4, 1000, 0.0, 0.5), ours=rounds(1.0, 400, 250.0, 1.5),
                  **{"sglang-router": rounds(0.6, 800, 100.0, 0.9)})
    figs = figures(res, compare(res))
    assert [(f.name, f.value, f.unit) for f in figs[:3]] == [
        ("added latency p50 at c=1, ours", 0.6, "ms"), ("added latency p50 at c=1, sglang-router (best peer)", 0.2, "ms"),
        ("added latency p50 at c=1, ours / sglang-router", 3.0, "x")]
    assert len(figs) == 12


def test_tracings_cost_is_each_traced_target_over_ours_untraced():
    res = results(direct=rounds(0.4, 1000, 0.0, 0.5), ours=rounds(1.0, 400, 200.0, 1.5),
                  **{"ours-traced": rounds(1.1, 380, 300.0, 1.6), "ours-traced-1pct": rounds(1.0, 400, 210.0, 1.5)})
    cost = compare(res)["tracing_cost"]
    assert cost["ours-traced"]["c32.router_cpu_us_per_request"]["ratio"] == 1.5
    assert cost["ours-traced-1pct"]["c32.router_cpu_us_per_request"]["ratio"] == 1.05
    names = {f.name: f.value for f in figures(res, compare(res))}
    assert names["router CPU per request at c=32, traces kept at 1 % / tracing off"] == 1.05
    assert names["router CPU per request at c=1, traces kept at 100 % / tracing off"] == 1.5
    assert compare(results(ours=rounds(1.0, 400, 200.0, 1.5)))["tracing_cost"] == {}
