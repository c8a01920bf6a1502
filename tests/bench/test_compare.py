"""``stage bench compare``: pure parts (configs, workloads, /metrics parsing, ratios, work per core, the
goals, the table) alone; flag errors through the real parser; and one short real run on the tiny model:
colocated, 1P1D and 1E1P1D stacks started one after the other (real router, real Redis, Mooncake),
pinned, each driven with every workload, then stopped, leaving no process. Every run is bounded
(request counts, --request-timeout-s, the subprocess timeout)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.compare import analysis, report
from bench.compare.cli import exit_code
from bench.compare.config import (DEFAULT_PINNING, PIN_ROLES, CompareConfig, Pinning, Sizing, select, workloads)
from bench.common.proc import group_pids
from bench.common.record import problems
from bench.compare.pool import Measured, merge_probes, pooled
from bench.compare.probe import delta, parse
from bench.serve.client import Outcome
from bench.serve.tokens import Counts
from bench.serve.workload import Request
from bench.serve.config import Slo
from cli import main as stage_main
from tests.support.generated_models import model_dir

REPO = Path(__file__).resolve().parents[2]
RUN_TIMEOUT_S = 420
WORKLOADS = ["single", "encode_heavy", "text_only", "repeated_images"]
STAGES = {"colocated": ["colocated"], "pd": ["prefill", "decode"], "epd": ["encoder", "prefill", "decode"]}
METRICS_TEXT = """\
# HELP epd_engine_step_seconds Seconds per engine step.
# TYPE epd_engine_step_seconds histogram
epd_engine_step_seconds_bucket{le="0.1"} 4.0
epd_engine_step_seconds_bucket{le="+Inf"} 4.0
epd_engine_step_seconds_count 4.0
epd_engine_step_seconds_sum 0.2
# HELP epd_generation_tokens Generated tokens.
# TYPE epd_generation_tokens counter
epd_generation_tokens_total 8.0
epd_generation_tokens_created 1.7e+09
# HELP epd_kv_transfer_seconds Seconds spent writing KV.
# TYPE epd_kv_transfer_seconds gauge
epd_kv_transfer_seconds{backend="mooncake"} 0.5
# HELP epd_router_stage_seconds Time one stage took.
# TYPE epd_router_stage_seconds histogram
epd_router_stage_seconds_sum{stage="prefill"} 1.5
epd_router_stage_seconds_count{stage="prefill"} 3.0
epd_router_stage_seconds_sum{stage="decode"} 2.0
epd_router_stage_seconds_count{stage="decode"} 3.0
# HELP epd_queue_depth Requests waiting.
# TYPE epd_queue_depth gauge
epd_queue_depth 2.0
"""


# --- configs -----------------------------------------------------------------------------------
@pytest.mark.unit
def test_pinning_defaults_overrides_and_refusals():
    pinning = Pinning()
    assert [role for role, _ in DEFAULT_PINNING] == list(PIN_ROLES)
    assert pinning.of("decode") == (1,) and pinning.of("prefill") == (0,) and pinning.of("client") == (0,)
    moved = pinning.overridden({"prefill": (0, 1)})
    assert moved.of("prefill") == (0, 1) and moved.of("decode") == (1,) and moved.all_cores() == {0, 1}
    with pytest.raises(ValueError, match=r"^--pin: unknown role gpu \(roles: client, router, redis, colocated, "):
        pinning.overridden({"gpu": (0,)})
    with pytest.raises(ValueError, match=r"^--pin: give each of client, .* once, got client$"):
        Pinning((("client", (0,)),))
    with pytest.raises(ValueError, match=r"^--pin decode: give one or more core numbers >= 0, got \[\]$"):
        pinning.overridden({"decode": ()})


@pytest.mark.unit
def test_workloads_are_the_four_described_each_with_its_own_seed():
    built = workloads(Sizing(num_requests=12, single_requests=3, output_len=8, image_size=(64, 48),
                             rates=(("text_only", 3.0),)))
    assert [w.name for w in built] == WORKLOADS
    single, heavy, text, repeated = built
    assert (single.mix.num_requests, single.load.max_concurrency, math.isinf(single.load.request_rate)) == (3, 1, True)
    assert single.mix.images_per_request == ((1, 1.0),) and single.mix.image_sizes == (((64, 48), 1.0),)
    assert heavy.mix.images_per_request == ((0, 0.75), (3, 0.25)) and heavy.load.request_rate == 1.0
    assert text.mix.images_per_request == ((0, 1.0),) and text.load.request_rate == 3.0
    assert repeated.mix.repeat_image_share == 0.85 and repeated.load.request_rate == 1.0
    assert {w.mix.output_len for w in built} == {8}
    assert len({w.mix.seed for w in built}) == 4
    assert heavy.what == ("~25% of requests (drawn) with 3 new 64x48 images, 75% ~16-word text turns; 8 tokens; "
                          "Poisson 1/s")
    assert [w.name for w in select(built, ("text_only", "single"))] == ["single", "text_only"]
    with pytest.raises(ValueError, match=r"^--workloads: unknown video \(known: single, encode_heavy, "):
        select(built, ("video",))


@pytest.mark.unit
@pytest.mark.parametrize("kw, message", [
    (dict(rates=(("single", 1.0),)), r"^--rates: unknown workload single \(loaded workloads: encode_heavy, "),
    (dict(rates=(("text_only", 0.0),)), r"^--rates: each rate must be a finite number > 0, got \{'text_only': 0.0\}$"),
    (dict(output_len=1), r"^--output-len must be >= 2 \(TPOT needs two tokens\), got 1$"),
    (dict(num_requests=0), r"^--num-requests and --single-requests must be >= 1$"),
])
def test_sizing_refusals_name_the_flag(kw, message):
    with pytest.raises(ValueError, match=message):
        Sizing(**kw)


@pytest.mark.unit
@pytest.mark.parametrize("kw, message", [
    (dict(deployments=("pd", "epd")), r"^--deployments must include colocated: every ratio is against it$"),
    (dict(deployments=("colocated", "xpd")), r"^--deployments: unknown xpd \(known: colocated, pd, epd\)$"),
    (dict(deployments=("colocated", "colocated")), r"^--deployments: give each deployment at most once"),
    (dict(slo=Slo()), r"^--slo: give at least one objective"),
    (dict(transfer="carrier-pigeon"), r"^--transfer must be one of mooncake, nixl, got 'carrier-pigeon'$"),
    (dict(workloads=()), r"^--workloads: give at least one workload$"),
    (dict(rounds=0), r"^--rounds must be >= 1, got 0$"),
])
def test_compare_config_refusals_name_the_flag(kw, message):
    with pytest.raises(ValueError, match=message):
        CompareConfig(model=Path("m"), out=Path("o"), **kw)


# every other role on a core this process may use, so that only core 999 is refused (whatever taskset allows)
_AVAILABLE_PINS = [f"--pin={role}={min(os.sched_getaffinity(0))}" for role in PIN_ROLES if role != "decode"]


@pytest.mark.unit
@pytest.mark.parametrize("flags, message", [
    (["--pin", "decode"], "--pin: cannot read 'decode' (expected ROLE=CORES, e.g. decode=1 or prefill=0-1)"),
    ([*_AVAILABLE_PINS, "--pin", "decode=999"], "--pin: core 999 is not available to this process (available: "),
    (["--rates", "text_only"], "--rates: cannot read 'text_only' (expected NAME=VALUE)"),
    (["--rates", "text_only=fast"], "--rates: text_only must be a number, got 'fast'"),
    (["--image-size", "big"], "--image-size: expected WxH, e.g. 448x448, got 'big'"),
    (["--deployments", "pd"], "--deployments must include colocated: every ratio is against it"),
    (["--model", "/nonexistent"], "--model /nonexistent is not a checkpoint directory (no config.json)"),
])
def test_bad_flags_exit_2_with_one_line_naming_the_flag(flags, message, capsys):
    assert stage_main(["bench", "compare", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"stage bench compare: error: {message}") and err.count("\n") == 1


@pytest.mark.unit
def test_rounds_reverse_the_order_every_other_round():
    config = CompareConfig(model=Path("m"), out=Path("o"))
    assert [config.order(i) for i in range(3)] == [("colocated", "pd", "epd"), ("epd", "pd", "colocated"),
                                                   ("colocated", "pd", "epd")]


# --- pooling -----------------------------------------------------------------------------------
def _round(ttfts: list[float], duration: float, cpu: float, steps: float) -> Measured:
    outcomes = [Outcome(True, 0.0, ttft + 0.3, ttft=ttft, itl=[0.1, 0.1], chunks=3, prompt_tokens=5, output_tokens=4)
                for ttft in ttfts]
    probe = {"machine": {"wall_s": duration, "client_cpu_s": 0.1, "loadavg_1m": [1.0, 1.0]},
             "roles": {"decode": {"cpu_s": cpu, "series": {"epd_engine_step_seconds_count": steps}},
                       "redis": {"cpu_s": 0.01}}}
    return Measured(outcomes, Counts([5] * len(ttfts), [4] * len(ttfts), {"input": {"usage": len(ttfts)},
                                                                           "output": {"usage": len(ttfts)}}),
                    duration, 0.1, probe)


@pytest.mark.unit
def test_rounds_pool_into_one_result_and_keep_each_rounds_numbers():
    requests = [Request([{"role": "user", "content": "hi"}], 4)] * 2
    result, samples = pooled([_round([0.1, 0.2], 2.0, 1.0, 10), _round([0.3], 4.0, 0.5, 5)], Slo(ttft_ms=250),
                             requests)
    assert (result["completed"], result["failed"], result["good_requests"], result["duration"]) == (3, 0, 2, 6.0)
    assert result["request_goodput"] == round(2 / 6.0, 4) and result["total_output_tokens"] == 12
    assert result["median_ttft_ms"] == 200.0
    assert result["token_counts"] == {"input": {"usage": 3}, "output": {"usage": 3}}
    assert [(r["completed"], r["good_requests"], r["duration"]) for r in result["per_round"]] == [(2, 2, 2.0),
                                                                                                 (1, 0, 4.0)]
    assert result["rounds"] == 2 and sorted(samples["ttft"]) == [0.1, 0.2, 0.3]
    assert result["probe"]["roles"] == {"decode": {"cpu_s": 1.5, "series": {"epd_engine_step_seconds_count": 15.0}},
                                        "redis": {"cpu_s": 0.02}}
    assert result["probe"]["machine"]["wall_s"] == 6.0 and result["probe"]["machine"]["client_cpu_s"] == 0.2
    assert len(merge_probes([_round([0.1], 1.0, 1.0, 1).probe])["machine"]["rounds"]) == 1


# --- /metrics ----------------------------------------------------------------------------------
@pytest.mark.unit
def test_metrics_parse_keeps_the_series_and_splits_router_stages():
    series = parse(METRICS_TEXT)
    assert series == {"epd_engine_step_seconds_count": 4.0, "epd_engine_step_seconds_sum": 0.2,
                      "epd_generation_tokens_total": 8.0, "epd_kv_transfer_seconds": 0.5,
                      "epd_router_stage_seconds_sum{stage=prefill}": 1.5,
                      "epd_router_stage_seconds_count{stage=prefill}": 3.0,
                      "epd_router_stage_seconds_sum{stage=decode}": 2.0,
                      "epd_router_stage_seconds_count{stage=decode}": 3.0}
    assert delta({"a": 1.0, "b": 2.0}, {"a": 1.5, "b": 2.0, "c": 3.0}) == {"a": 0.5, "b": 0.0, "c": 3.0}


# --- analysis and report -----------------------------------------------------------------------
def _result(ttft: float, tpot: float, e2e: float, good: int, completed: int = 4, roles: dict | None = None,
            client_cpu: float = 0.4) -> dict:
    return {"median_ttft_ms": ttft, "p99_ttft_ms": ttft * 2, "median_tpot_ms": tpot, "p99_tpot_ms": tpot * 2,
            "request_goodput": good / 10, "median_e2el_ms": e2e, "p99_e2el_ms": e2e * 2, "good_requests": good,
            "completed": completed, "failed": 0,
            "probe": {"machine": {"wall_s": 10.0, "client_cpu_s": client_cpu}, "roles": roles or {}}}


def _engine(busy: float, steps: float, tokens: float, cpu: float, prompt: float = 0.0) -> dict:
    return {"cpu_s": cpu, "series": {"epd_engine_step_seconds_sum": busy, "epd_engine_step_seconds_count": steps,
                                     "epd_generation_tokens_total": tokens, "epd_prompt_tokens_total": prompt}}


def _results() -> dict:
    colocated_roles = {"colocated": _engine(4.0, 100, 128, 4.0), "router": {"cpu_s": 0.2, "series": {}}}
    epd_roles = {"encoder": {"cpu_s": 1.0, "series": {"epd_encoder_seconds_sum": 1.2, "epd_encoder_seconds_count": 3,
                                                      "epd_encoder_images_encoded_total": 4}},
                 "prefill": _engine(0.8, 4, 4, 0.8, prompt=2000), "decode": _engine(2.0, 100, 128, 2.0),
                 "router": {"cpu_s": 0.4, "series": {"epd_router_stage_seconds_sum{stage=encoder}": 0.4,
                                                     "epd_router_stage_seconds_count{stage=encoder}": 4}},
                 "redis": {"cpu_s": 0.0}}
    placed = {"colocated": {"cores": [1]}, "router": {"cores": [0]}, "encoder": {"cores": [0]},
              "prefill": {"cores": [0]}, "decode": {"cores": [1]}, "redis": {"cores": [0]}}
    return {"colocated": {"placed": placed, "workloads": {
                "single": _result(100, 10, 400, 4, roles=colocated_roles),
                "encode_heavy": _result(200, 40, 1500, 2, roles=colocated_roles)}},
            "epd": {"placed": placed, "workloads": {
                "single": _result(110, 10, 420, 4, roles=epd_roles),
                "encode_heavy": _result(250, 15, 800, 4, roles=epd_roles)}}}


@pytest.mark.unit
def test_ratios_work_per_core_and_unit_costs():
    results = _results()
    times = analysis.ratios(results)
    assert list(times) == ["epd"]
    assert times["epd"]["encode_heavy"] == {"ttft_p50": 1.25, "ttft_p99": 1.25, "tpot_p50": 0.375, "tpot_p99": 0.375,
                                            "goodput": 2.0, "e2e_p50": 0.533, "e2e_p99": 0.533}
    work = analysis.stage_work(results["epd"]["workloads"]["encode_heavy"], results["epd"]["placed"], (0,))
    # core 0: encoder 1.0 + prefill 0.8 + router 0.4 + redis 0 + client 0.4 = 2.6 s over 4 requests
    assert work["cores"] == {"0": {"cpu_s": 2.6, "cpu_ms_per_request": 650.0, "cpu_share": 0.26},
                             "1": {"cpu_s": 2.0, "cpu_ms_per_request": 500.0, "cpu_share": 0.2}}
    assert work["busiest_core"] == "0" and work["capacity_rps"] == 1.538
    assert work["roles"]["encoder"] == {"cpu_s": 1.0, "cpu_ms_per_request": 250.0, "busy_s": 1.2,
                                        "busy_ms_per_request": 300.0, "busy_fraction": 0.12, "ms_per_image": 300.0,
                                        "cpu_ms_per_image": 250.0, "cpu_of_busy": 0.833}
    assert work["roles"]["prefill"]["ms_per_1k_prompt_tokens"] == 400.0
    assert work["roles"]["decode"]["ms_per_step"] == 20.0 and work["roles"]["decode"]["tokens_per_step"] == 1.28
    assert work["roles"]["decode"]["cpu_ms_per_output_token"] == 15.62
    assert work["roles"]["client"]["busy_s"] is None


@pytest.mark.unit
def test_goals_are_judged_against_their_targets_with_the_facts():
    results = _results()
    goals = analysis.goals(results, analysis.all_stage_work(results, (0,)))
    assert [(g["goal"], g["ratio"], g["met"]) for g in goals] == [
        ("tpot_p99_encode_heavy", 0.375, True), ("goodput_encode_heavy", 2.0, True),
        ("e2e_single_request", 1.05, True)]
    tpot, goodput, e2e = goals
    assert tpot["facts"]["ratio_floor"] == 0.25  # a 20 ms decode step over colocated's 80 ms p99 TPOT
    assert tpot["facts"]["encoder_ms_per_image"] == 300.0
    assert goodput["facts"]["ceiling_at_this_rate"] == 2.0
    assert goodput["facts"]["capacity_ratio"] == 1.538  # colocated's core 1: 1000 ms per request, epd's core 0: 650
    assert e2e["facts"]["router_stage_call_ms"] == {"encoder": 100.0}
    assert "+20.0 ms" in e2e["why"]
    results["epd"]["workloads"]["single"]["median_e2el_ms"] = 480
    assert analysis.goals(results, analysis.all_stage_work(results, (0,)))[2]["met"] is False


@pytest.mark.unit
def test_table_rows_show_ratios_and_counts():
    results = _results()
    rep = {"config": {"slo": {"tpot_ms": 50.0}, "workloads": [{"name": "encode_heavy", "what": "heavy"}]},
           "deployments": results, "ratios": analysis.ratios(results)}
    lines = report.table(rep).splitlines()
    assert lines[0] == "latencies in ms; (ratio vs colocated); goodput = requests/s meeting tpot_ms <= 50; " \
                       "counts good/ok/sent"
    assert lines[2] == "encode_heavy: heavy"
    assert lines[4].split() == ["colocated", "200", "400", "40.0", "80.0", "0.200", "1500", "3000", "2/4/4"]
    assert lines[5].split() == ["epd", "250", "(1.25x)", "500", "(1.25x)", "15.0", "(0.38x)", "30.0", "(0.38x)",
                                "0.400", "(2.00x)", "800", "(0.53x)", "1600", "(0.53x)", "4/4/4"]
    assert exit_code({"deployments": results}) == 0
    assert exit_code({"deployments": {**results, "pd": {"errors": ["pd could not start"]}}}) == 3


# --- a real run ----------------------------------------------------------------------------------
def test_compare_runs_every_deployment_and_workload_on_the_tiny_model(tmp_path):
    cores = sorted(os.sched_getaffinity(0))
    first, last = cores[0], cores[-1]
    pins = [f"--pin={role}={first}" for role in ("client", "router", "redis", "encoder", "prefill")]
    pins += [f"--pin={role}={last}" for role in ("colocated", "decode")]
    out = tmp_path / "compare"
    proc = subprocess.run(
        [sys.executable, "-m", "cli", "bench", "compare", "--model", str(model_dir("qwen2_vl")),
         "--num-requests", "3", "--single-requests", "2", "--output-len", "4", "--image-size", "64x64",
         "--rates", "encode_heavy=8,text_only=8,repeated_images=8", "--slo", "ttft_ms=60000,tpot_ms=10000",
         "--request-timeout-s", "60", "--startup-timeout-s", "120", "--rounds", "1", "--out", str(out),
         "--no-progress", "--summary-dir", str(tmp_path / "summaries"), *pins],
        cwd=REPO, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    rep = json.loads((out / "compare.json").read_text())
    assert list(rep["deployments"]) == ["colocated", "pd", "epd"]
    for mode, deployment in rep["deployments"].items():
        assert list(deployment["workloads"]) == WORKLOADS
        for name, result in deployment["workloads"].items():
            sent = 2 if name == "single" else 3
            assert (result["completed"], result["failed"], result["good_requests"]) == (sent, 0, sent), (mode, name)
            assert result["total_output_tokens"] == 4 * sent
            assert set(result["probe"]["roles"]) >= {"router", *STAGES[mode]}
        placed = deployment["placed"]
        assert placed["decode" if mode != "colocated" else "colocated"]["cores"] == [last]
        assert placed["router"]["cores"] == [first]
        for group in placed.values():  # stopped: no process of the stack is left
            assert all(not Path(f"/proc/{pid}").exists() or _zombie(pid) for pid in group["pids"])
    encoder_series = rep["deployments"]["epd"]["workloads"]["repeated_images"]["probe"]["roles"]["encoder"]["series"]
    distinct = rep["deployments"]["epd"]["workloads"]["repeated_images"]["workload"]["distinct_images"]
    assert encoder_series["epd_encoder_images_encoded_total"] == distinct  # repeats come from the cache
    assert list(rep["ratios"]) == ["pd", "epd"] and list(rep["ratios"]["epd"]) == WORKLOADS
    assert [(g["mode"], g["goal"]) for g in rep["goals"]] == [
        (mode, goal) for mode in ("pd", "epd")
        for goal in ("tpot_p99_encode_heavy", "goodput_encode_heavy", "e2e_single_request")]
    assert rep["config"]["pinning"]["decode"] == [last] and rep["machine"]["cpu_count"] == os.cpu_count()
    assert (out / "compare.png").stat().st_size > 0
    assert sorted(p.name for p in out.glob("compare_cdf_*.png")) == sorted(f"compare_cdf_{w}.png" for w in WORKLOADS)
    assert len([line for line in (out / "compare.md").read_text().splitlines() if line.startswith("| ")]) == 1 + 12
    assert (out / "logs" / "epd" / "encoder.log").exists()
    written = list((tmp_path / "summaries").iterdir())
    assert [p.name.split("--")[0] for p in written] == ["compare"]  # one summary, named by its flags
    summary = json.loads(written[0].read_text())
    assert problems(summary) == [] and summary["benchmark"] == "compare" and "rounds=1" in summary["configuration"]
    assert [f["name"] for f in summary["figures"][:3]] == [
        f"pd / colocated, {goal} (goal {target}x)"
        for goal, target in (("tpot_p99_encode_heavy", "0.5"), ("goodput_encode_heavy", "2"), ("e2e_single_request", "1.1"))]
    assert "goals (ratio vs colocated):" in proc.stdout and "encode_heavy: ~25% of requests (drawn)" in proc.stdout


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "Z"
    except OSError:
        return True


def test_group_pids_finds_a_process_group(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], process_group=0)
    try:
        assert group_pids(proc.pid) == [proc.pid]
    finally:
        proc.kill()
        proc.wait(10)
