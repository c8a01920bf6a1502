"""bench.fleet_scale's pure parts: the recorded load and its Prometheus text as the router reads it,
the statistics, the CPU figures and the table.

And the benchmark's in-process measures (``bench.fleet_scale.inproc``), smoke-tested at N=8."""

from __future__ import annotations

import pytest

from bench.fleet_scale.analysis import growth, idle_cores, per_request, timing
from bench.fleet_scale.inproc import hot_path, planner
from bench.fleet_scale.load import MODEL, PHASE_S, ROLES, counters, integral, jitter, metrics_text
from bench.fleet_scale.report import figures, table
from router.fleet.load import History, parse_sample, role_loads
from router.plan.ratio import recommend

pytestmark = pytest.mark.unit


def test_the_phases_alternate_image_heavy_and_text_only():
    assert integral("encoder", PHASE_S) > 0
    assert integral("encoder", 2 * PHASE_S) == integral("encoder", PHASE_S)  # text-only: no image
    assert integral("prefill", 2 * PHASE_S) > integral("prefill", PHASE_S)
    assert integral("decode", 4 * PHASE_S) == pytest.approx(2 * integral("decode", 2 * PHASE_S))


def test_every_worker_counts_differently_but_deterministically():
    assert len({round(jitter(i), 6) for i in range(256)}) == 256
    assert all(0.8 <= jitter(i) <= 1.2 for i in range(256))
    assert metrics_text("prefill", 5, 33.0) == metrics_text("prefill", 5, 33.0)
    assert counters("decode", 1, 10.0)["units"] != counters("decode", 2, 10.0)["units"]


@pytest.mark.parametrize("role", ROLES)
def test_the_router_reads_the_fake_metrics_as_a_stage_s(role):
    sample = parse_sample(role, metrics_text(role, 3, 30.0), 1.0)
    c = counters(role, 3, 30.0)
    assert sample.units == pytest.approx(c["units"])
    assert sample.busy_s == pytest.approx(c["busy_s"])
    assert sample.queue_depth == c["queue"] and sample.running == c["running"]


def test_the_planner_sees_the_phase_of_the_recorded_load():
    def split_at(end: float) -> tuple[dict, dict]:
        history = History(60.0)
        for step in range(13):
            t = end - 60.0 + 5.0 * step
            history.add_router(t, {})
            for role in ROLES:
                for i in range(4):
                    history.add(f"{role}{i}", parse_sample(role, metrics_text(role, i, t), t))
        loads, _ = role_loads(history, end, 60.0, {r: 4 for r in ROLES}, ROLES)
        return {load.role: load.need for load in loads}, recommend(loads, 120)

    (heavy, heavy_split), (light, light_split) = split_at(99.0), split_at(119.0)  # mostly image-heavy, text-only
    assert heavy["encoder"] > 1.5 * light["encoder"] and heavy["prefill"] > light["prefill"]
    assert heavy_split["encoder"] > light_split["encoder"]
    assert sum(heavy_split.values()) == sum(light_split.values()) == 120


def test_timing_in_microseconds():
    t = timing([0.001] * 99 + [0.002])
    assert t == {"n": 100, "median_us": 1000.0, "p99_us": 1000.0, "max_us": 2000.0}
    assert timing([]) == {"n": 0}


def test_cpu_per_request_less_the_idle_rate():
    assert idle_cores(0.5, 10.0) == 0.05 and idle_cores(1.0, 0.0) is None
    r = per_request(cpu_s=1.5, wall_s=10.0, answered=1000, idle=0.05)
    assert r["cpu_ms"] == 1.5 and r["net_cpu_ms"] == 1.0 and r["requests_per_s"] == 100.0
    assert per_request(1.0, 1.0, 0, None)["cpu_ms"] is None
    assert growth({8: 1.0, 64: 2.0, 256: 4.0}) == 4.0 and growth({8: None, 256: 1.0}) is None


def test_table_and_figures_name_each_size():
    stats = {"median_us": 1500.0, "p99_us": 2000.0}
    plan = {8: {"decision": stats, "report": stats, "parse": {"median_us": 250.0}}}
    hot = {8: {"plan_round_robin": {"median_us": 20.0}, "plan_prefix_aware": {"median_us": 40.0}}}
    live = {8: {"idle": {"cores": 0.01}, "phases": {"c1": {"cpu_ms": 0.4, "net_cpu_ms": 0.35},
                                                     "c16": {"cpu_ms": 0.2, "net_cpu_ms": 0.18}}}}
    text = table(plan, hot, live, 16)
    assert "| 8 | 1.5 / 2 | 1.5 | 250 | 20 / 40 | 0.4 (0.35) | 0.2 (0.18) | 0.01 |" in text
    names = [f.name for f in figures(plan, hot, live, 16)]
    assert "N=8: planner decision median" in names and "N=8: router idle CPU" in names
    assert all(f.value is not None for f in figures(plan, hot, live, 16))


@pytest.mark.parametrize("n", [8])
def test_the_in_process_measures_run_and_the_planner_follows_the_phases(n):
    p = planner(n, 5, 1.0)
    assert p["decision"]["n"] >= 3 and p["parse"]["n"] == 3 * n * 2 * p["samples_per_worker"]
    assert p["splits"]["image_heavy"]["encoder"] > p["splits"]["text_only"]["encoder"]
    h = hot_path(n, 5, 1.0)
    assert all(h[k]["n"] >= 3 for k in ("stage_limits", "serves", "video_support", "plan_round_robin",
                                         "plan_least_load", "plan_prefix_aware"))
