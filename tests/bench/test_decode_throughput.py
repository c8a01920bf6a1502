"""The pure parts of bench/decode_throughput/: requests per level, the best run of each side, ours /
HF (the ratios bench/README.md quotes), the goal and the summary's figures."""

from __future__ import annotations

import pytest

from bench.decode_throughput.analysis import TARGET_RATIO, best_hf, best_level, goal
from bench.decode_throughput.report import figures
from bench.decode_throughput.workload import QUESTIONS, requests_for, workload

pytestmark = pytest.mark.unit


def hf_run(tokens_per_s, tokens_per_cpu_s):
    return {"tokens_per_s": tokens_per_s, "tokens_per_cpu_s": tokens_per_cpu_s, "per_request": [{"seconds": 1}]}


def level_run(concurrency, tokens_per_s, tokens_per_cpu_s):
    return {"concurrency": concurrency, "tokens_per_s": tokens_per_s, "tokens_per_server_cpu_s": tokens_per_cpu_s}


def test_requests_per_level_are_twice_the_streams_within_bounds():
    assert [requests_for(c, 64) for c in (1, 8, 32, 64)] == [8, 16, 64, 64]
    assert requests_for(32, 16) == 32  # never fewer than the streams


def test_the_workload_cycles_questions_and_sixteen_images():
    image, question = workload(len(QUESTIONS) + 1)
    assert question == QUESTIONS[1] and image.size == (64, 64)


def test_best_hf_keeps_the_fastest_run_and_the_best_cpu_rate():
    best = best_hf([hf_run(30.0, 40.0), hf_run(31.0, 35.0)], load_s=2.345)
    assert (best["tokens_per_s"], best["tokens_per_cpu_s"], best["load_s"]) == (31.0, 40.0, 2.35)
    assert [r["tokens_per_s"] for r in best["runs"]] == [30.0, 31.0] and "per_request" not in best["runs"][0]


def test_best_level_gives_ours_over_hf_by_wall_clock_and_per_cpu_second():
    hf = {"tokens_per_s": 31.0, "tokens_per_cpu_s": 40.0}
    level = best_level([level_run(32, 200.0, 300.0), level_run(32, 216.9, 280.0)], hf)
    assert (level["tokens_per_s"], level["tokens_per_server_cpu_s"]) == (216.9, 300.0)
    assert (level["ratio_vs_hf"], level["cpu_normalized_ratio_vs_hf"]) == (7.0, 7.5)
    assert len(level["runs"]) == 2
    unknown = best_level([level_run(1, 28.0, None)], hf)
    assert unknown["ratio_vs_hf"] == 0.9 and "cpu_normalized_ratio_vs_hf" not in unknown


def test_the_goal_is_eight_times_hf_at_32_streams():
    assert goal([{"concurrency": 8, "ratio_vs_hf": 9.0}]) == {"ratio": TARGET_RATIO, "at_streams": 32, "met": None,
                                                               "met_cpu_normalized": None}
    at = goal([{"concurrency": 32, "ratio_vs_hf": 8.0, "cpu_normalized_ratio_vs_hf": 7.99}])
    assert (at["met"], at["met_cpu_normalized"]) == (True, False)


def test_figures_are_hf_and_each_level_with_its_ratio():
    figs = figures({"tokens_per_s": 31.0}, [{"concurrency": 32, "tokens_per_s": 216.9, "ratio_vs_hf": 7.0}])
    assert [(f.name, f.value, f.unit) for f in figs] == [("HF generate(), 1 at a time", 31.0, "tok/s"),
                                                         ("32 streams", 216.9, "tok/s"),
                                                         ("32 streams / HF generate()", 7.0, "x")]
