"""The pure parts of bench/check_against_aiperf.py: ours / aiperf per measure over rounds with the
10% verdict (the ratios bench/README.md quotes), the truth against the paced server, and the figures."""

from __future__ import annotations

from argparse import Namespace

import pytest

from bench.check_against_aiperf import COMPARED, compare, expected, figures

pytestmark = pytest.mark.unit

KEYS = (*COMPARED, "ttft_p99_ms", "tpot_mean_ms", "e2el_mean_ms", "total_input_tokens", "total_output_tokens")


def tool(**values):
    return {key: values.get(key, 1.0) for key in KEYS}


def test_compare_takes_means_over_rounds_and_the_ratio_ours_over_aiperf():
    rounds = [{"ours": tool(ttft_mean_ms=160.0, request_throughput=1.5), "aiperf": tool(ttft_mean_ms=170.0)},
              {"ours": tool(ttft_mean_ms=170.0, request_throughput=1.5), "aiperf": tool(ttft_mean_ms=170.0)}]
    out = compare(rounds, None)
    assert out["ttft_mean_ms"] == {"ours": 165.0, "aiperf": 170.0, "ratio": 0.9706, "within_10pct": True}
    assert out["request_throughput"]["ratio"] == 1.5 and out["request_throughput"]["within_10pct"] is False
    assert list(out) == list(KEYS[:4]) + ["ttft_p99_ms", "tpot_mean_ms", "e2el_mean_ms", "total_input_tokens",
                                          "total_output_tokens"]


def test_the_paced_server_gives_what_a_perfect_client_measures():
    args = Namespace(server="paced", paced_ttft_ms=100.0, paced_itl_ms=20.0, requests=10, request_rate=None,
                     concurrency=4)
    truth = expected(args, {"mean_max_tokens": 11.0})
    assert (truth["e2el_mean_ms"], truth["request_throughput"], truth["output_throughput"]) == (300.0, 4 / 0.3, 44 / 0.3)
    assert expected(Namespace(server="colocated"), {}) is None
    out = compare([{"ours": tool(ttft_mean_ms=108.0), "aiperf": tool(ttft_mean_ms=110.0)}], truth)
    assert out["ttft_mean_ms"]["expected"] == 100.0
    named = {f.name: (f.value, f.unit) for f in figures(out)}
    assert named["ttft_mean_ms: ours / aiperf"] == (0.9818, "x")
    assert named["ttft_mean_ms, expected (paced server)"] == (100.0, "ms")
