"""bench/chunked_prefill/: the long prompts' variants and bodies, the pure analysis (TPOT per request,
each stream's first request left out, ratios to the phase without arrivals, the goal, what makes a run
unfit to record), the summary's figures; and one short real run on the tiny model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.chunked_prefill.analysis import (GOAL_RATIO, goal, load_stats, lone_stats, pool, problems, ratios,
                                            replay_ratios, tpot, tpot_and_gaps)
from bench.chunked_prefill.report import figures
from bench.chunked_prefill.workload import HEAD, body, stream_payload, variant
from bench.common.record import problems as summary_problems
from bench.serve.client import Outcome
from tests.support.generated_models import model_dir

REPO = Path(__file__).resolve().parents[2]
RUN_TIMEOUT_S = 240


def ok(latency, ttft, tokens, itl=()):
    return Outcome(True, 0.0, latency, ttft=ttft, itl=list(itl), output_tokens=tokens, prompt_tokens=2000)


def failed():
    return Outcome(False, 0.0, 1.0, error="HTTP 500: boom")


def phase(tpot_ms, itl_ms, arrivals=1, lone_ms=None):
    load = {"p99_tpot_ms": tpot_ms, "p99_itl_ms": itl_ms, "arrivals": arrivals, "stream_failed": 0,
            "arrivals_failed": 0, "stream_errors": [], "arrival_errors": []}
    return {"load": load, "budget": 8192, **({"lone": {"ttft_ms_median": lone_ms, "failed": 0}} if lone_ms else {})}


@pytest.mark.unit
def test_variants_shuffle_the_words_after_the_head_and_keep_them():
    text = HEAD + "one two three four five six seven"
    assert variant(text, 0) == text
    shuffled = [variant(text, k) for k in (1, 2)]
    assert all(v.startswith(HEAD) and sorted(v.removeprefix(HEAD).split()) == sorted(text.removeprefix(HEAD).split())
               for v in shuffled)
    assert shuffled[0] != shuffled[1] and variant(text, 1) == shuffled[0]


@pytest.mark.unit
def test_bodies_are_streamed_greedy_and_ignore_eos():
    b = body("m", "hi", 8)
    assert (b["model"], b["max_tokens"], b["temperature"], b["ignore_eos"], b["stream"]) == ("m", 8, 0, True, True)
    assert b["stream_options"] == {"include_usage": True}
    assert "Stream 3, request 5" in json.loads(stream_payload("m", 3, 5, 64))["messages"][0]["content"][0]["text"]


@pytest.mark.unit
def test_tpot_is_per_request_and_none_without_two_tokens():
    assert tpot(ok(1.1, 0.1, 11)) == 0.1
    assert tpot(ok(1.0, 0.1, 1)) is None and tpot(failed()) is None


@pytest.mark.unit
def test_rounds_pool_and_load_stats_count_every_stream_request():
    first = {"streams": [[ok(0.4, 0.1, 4, [0.1, 0.1, 0.1])], [ok(0.7, 0.1, 4, [0.1, 0.4, 0.1])]],
             "longs": [ok(1.0, 0.5, 8)], "long_sent_at_s": [2.0], "wall_s": 5.0}
    second = {"streams": [[ok(1.0, 0.1, 4, [0.1, 0.7, 0.1]), failed()]], "longs": [failed()], "long_sent_at_s": [2.1],
              "wall_s": 5.5}
    pooled = pool([first, second])
    assert (len(pooled["streams"]), pooled["long_sent_at_s"], pooled["wall_s"]) == (3, [[2.0], [2.1]], 10.5)
    stats = load_stats(pooled)
    assert (stats["stream_requests"], stats["stream_failed"], stats["median_tpot_ms"]) == (4, 1, 200.0)
    assert stats["max_itl_ms"] == 700.0 and stats["p99_itl_ms"] < 700.0
    assert (stats["arrivals"], stats["arrivals_failed"], stats["arrival_errors"]) == (2, 1, ["HTTP 500: boom"])
    assert stats["median_arrival_ttft_ms"] == 500.0 and stats["arrival_prompt_tokens"] == [2000, None]


@pytest.mark.unit
def test_a_replay_gives_tpot_and_gaps_from_its_stamps_and_ratios_over_alone():
    replay = {"streams": [[[0.0, 0.1, 0.2, 0.3]], [[0.0, 0.1, 0.5, 0.6], [0.6, 0.7]]], "longs": [(2.0, 2.8)],
              "clock_s": 21.234}
    stats = tpot_and_gaps(replay)  # the one-token request has no TPOT
    assert (stats["stream_requests"], stats["median_tpot_ms"], stats["max_itl_ms"]) == (2, 175.0, 400.0)
    assert (stats["arrivals"], stats["median_arrival_ttft_ms"], stats["clock_s"]) == (1, 800.0, 21.23)
    assert replay_ratios({"alone": {"p99_tpot_ms": 20.0, "p99_itl_ms": 25.0},
                          "chunked": {"p99_tpot_ms": 30.0, "p99_itl_ms": 100.0}}) == \
        {"chunked": {"tpot_p99": 1.5, "itl_p99": 4.0}}


@pytest.mark.unit
def test_lone_stats_leave_the_warmup_out():
    stats = lone_stats([ok(5.0, 4.0, 8), ok(1.0, 0.6, 8), ok(1.0, 0.8, 8)])
    assert (stats["requests"], stats["failed"], stats["ttft_ms_median"], stats["ttft_ms_min"]) == (2, 0, 700.0, 600.0)
    assert lone_stats([ok(5.0, 4.0, 8)])["ttft_ms_median"] is None


@pytest.mark.unit
def test_ratios_are_over_the_phase_without_arrivals_and_the_goal_is_judged_on_chunked():
    phases = {"alone": phase(30.0, 40.0, arrivals=0), "chunked": phase(54.0, 120.0, lone_ms=880.0),
              "unchunked": phase(66.0, 800.0, lone_ms=800.0)}
    by_phase = ratios(phases)
    assert by_phase == {"chunked": {"tpot_p99": 1.8, "itl_p99": 3.0, "lone_ttft_vs_unchunked": 1.1},
                        "unchunked": {"tpot_p99": 2.2, "itl_p99": 20.0, "lone_ttft_vs_unchunked": 1.0}}
    assert goal(by_phase) == {"ratio": GOAL_RATIO, "metric": "p99 TPOT chunked / alone", "value": 1.8, "met": True}
    assert goal({})["met"] is None and goal({"chunked": {"tpot_p99": 2.01}})["met"] is False
    assert problems(phases) == []
    phases["chunked"]["load"].update(arrivals=0, stream_failed=1, stream_errors=["x"])
    assert problems(phases) == ["chunked: 1 stream and 0 arriving requests failed: ['x']",
                                "chunked: no long prompt arrived (the streams ended before the first period)"]


@pytest.mark.unit
def test_figures_put_the_goal_ratio_first_among_ratios():
    phases = {"alone": phase(30.0, 40.0, arrivals=0), "unchunked": phase(66.0, 800.0, lone_ms=800.0),
              "chunked": phase(54.0, 120.0, lone_ms=880.0)}
    costs = [{"budget": 256, "chunk_over_decode": 3.5, "prefill_ms": 800.0}]
    names = [(f.name, f.value, f.unit) for f in figures(phases, ratios(phases), costs, {"chunked": {"tpot_p99": 1.2,
                                                                                                "itl_p99": 3.0}})]
    assert names[3] == ("TPOT p99 chunked / alone (goal 2x)", 1.8, "x")
    assert ("lone long prompt TTFT chunked / unchunked", 1.1, "x") in names
    assert ("replay (engine CPU clock): TPOT p99 chunked / alone", 1.2, "x") in names
    assert names[-2:] == [("engine, budget 256: step with a chunk / decode step", 3.5, "x"),
                          ("engine, budget 256: long prompt prefill", 800.0, "ms")]


def test_a_short_real_run_on_the_tiny_model(tmp_path):
    out = tmp_path / "chunked_prefill.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.chunked_prefill", "--model-dir", str(model_dir("qwen2_vl")), "--streams", "2",
         "--stream-tokens", "6", "--duration-s", "2.5", "--period-s", "0.8", "--long-tokens", "200",
         "--long-max-tokens", "2", "--sweep", "", "--cost-budgets", "64,512", "--lone-requests", "1",
         "--unchunked", "4096", "--rounds", "1", "--replay-s", "1.5", "--startup-timeout", "120", "--request-timeout", "60", "--out", str(out),
         "--summary-dir", str(tmp_path / "summaries")],
        cwd=REPO, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rep = json.loads(out.read_text())
    assert list(rep["phases"]) == ["alone", "chunked", "unchunked"] and rep["problems"] == []
    assert rep["phases"]["unchunked"]["budget"] == 4096
    for name, p in rep["phases"].items():
        load = p["load"]
        assert load["stream_requests"] > 0 and load["stream_failed"] == load["arrivals_failed"] == 0, name
        assert 0 < load["median_tpot_ms"] <= load["p99_tpot_ms"] < 1000 and load["p99_itl_ms"] <= load["max_itl_ms"]
        assert (load["arrivals"] > 0) == (name != "alone"), name
        assert all(150 < n < 260 for n in load["arrival_prompt_tokens"])
    assert 0 < rep["phases"]["chunked"]["lone"]["ttft_ms_median"] < 5000 and "lone" not in rep["phases"]["alone"]
    assert [row["budget"] for row in rep["engine_step_costs"]] == [64, 512]
    small, large = rep["engine_step_costs"]
    assert small["chunk_steps"] > large["chunk_steps"] == 1 and small["decode_step_ms"] > 0
    assert set(rep["ratios_vs_alone"]) == {"chunked", "unchunked"} and rep["goal"]["value"] > 0
    assert list(rep["replay"]["phases"]) == ["alone", "chunked", "unchunked"]
    assert rep["replay"]["phases"]["alone"]["arrivals"] == 0 < rep["replay"]["phases"]["chunked"]["arrivals"]
    assert all(p["stream_requests"] > 0 and p["p99_tpot_ms"] > 0 for p in rep["replay"]["phases"].values())
    assert out.with_suffix(".png").stat().st_size > 0
    written = list((tmp_path / "summaries").iterdir())
    assert len(written) == 1 and written[0].name.startswith("chunked_prefill--")
    assert summary_problems(json.loads(written[0].read_text())) == []
