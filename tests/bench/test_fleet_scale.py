"""bench.fleet_scale's pure parts: the recorded load and its Prometheus text as the router reads it,
the statistics, the CPU figures and the table.

Also the benchmark's in-process measures (``planner``, ``hot_path``: they import the router, which
``bench`` may not, tests/test_import_graph.py), run by ``python -m bench.fleet_scale`` as
``python -m tests.bench.test_fleet_scale --sizes 8,64,256 --out F.json`` (a child process) and
smoke-tested here at N=8."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Callable

import pytest

from bench.fleet_scale.analysis import growth, idle_cores, per_request, timing
from bench.fleet_scale.load import MODEL, PHASE_S, ROLES, counters, integral, jitter, metrics_text
from bench.fleet_scale.report import figures, table
from router.admin.ratio_loop import report
from router.config import RouterConfig
from router.fleet.breaker import CircuitBreaker
from router.fleet.load import History, parse_sample, role_loads
from router.fleet.registry import Registry
from router.fleet.workers import Worker
from router.metrics import Metrics
from router.plan.modes import Call, PDPlanner
from router.plan.policy import make_policy
from router.plan.ratio import recommend
from router.runtime import Router

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


# --- the in-process measures (run by bench.fleet_scale) ---------------------------------------------
WINDOW_S = 60.0  # the router's default --ratio-window-s
EVERY_S = 5.0  # router.fleet.scrape.period(60): a sample every 5 s
FP = {"model": MODEL, "block_size": 16}
BODY = (b'{"model":"fake-model","messages":[{"role":"user","content":"Hello! How far is the moon? '
        b'Tell me in a few words."}],"max_tokens":8,"temperature":0}')


def timed(fn: Callable[[], object], repeats: int, budget_s: float) -> list[float]:
    """Seconds of each call of ``fn``: ``repeats`` calls, fewer if ``budget_s`` runs out (at least 3)."""
    out: list[float] = []
    deadline = time.perf_counter() + budget_s
    while len(out) < repeats and (len(out) < 3 or time.perf_counter() < deadline):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def filled_history(n: int, now: float, load_at: float) -> tuple[History, dict[str, list[str]], list[float]]:
    """A History of ``n`` workers per role with a window of samples ending at ``now`` (monotonic), the
    load read from ``load_at - WINDOW_S`` to ``load_at`` seconds into the recorded trajectory; the worker
    ids per role and the seconds each ``parse_sample`` took."""
    history = History(WINDOW_S)
    ids = {role: [f"{role[0]}{i}" for i in range(n)] for role in ROLES}
    parses: list[float] = []
    steps = int(WINDOW_S / EVERY_S)
    for step in range(steps + 1):
        back = (steps - step) * EVERY_S
        history.add_router(now - back, {"images": 0.0})
        for role in ROLES:
            for i, worker in enumerate(ids[role]):
                text = metrics_text(role, i, load_at - back)
                t0 = time.perf_counter()
                sample = parse_sample(role, text, now - back)
                parses.append(time.perf_counter() - t0)
                history.add(worker, sample)
    return history, ids, parses


def planner(n: int, repeats: int, budget_s: float) -> dict:
    """Planner decision time over ``n`` workers per role, at the end of an image-heavy phase and of a
    text-only one: ``role_loads`` + ``recommend``, and the whole ``report`` over a Registry of them."""
    out: dict = {"n": n}
    registry = Registry("epd", {role: make_policy("round_robin") for role in ROLES}, Metrics(),
                        lambda: CircuitBreaker(3, 10.0))
    for role in ROLES:
        for i in range(n):
            registry.add(Worker(f"http://127.0.0.1:{10000 + ROLES.index(role) * 1000 + i}", role,
                                CircuitBreaker(3, 10.0), healthy=True, known=True, models=(MODEL,)))
    by_role = {role: [w.id for w in registry.pools[role].workers] for role in ROLES}
    decisions: list[float] = []
    reports: list[float] = []
    parses: list[float] = []
    splits = {}
    for phase, load_at in (("image_heavy", 80.0 + 19.0), ("text_only", 80.0 + 39.0)):
        now = time.monotonic()
        history, ids, phase_parses = filled_history(n, now, load_at)
        parses += phase_parses
        # the registry's ids for the report
        for role in ROLES:
            for mine, theirs in zip(ids[role], by_role[role]):
                history._workers[theirs] = history._workers.pop(mine)
        workers = {role: n for role in ROLES}

        def decide() -> dict | None:
            loads, _ = role_loads(history, now, WINDOW_S, workers, ROLES)
            return recommend(loads, 3 * n)

        splits[phase] = decide()
        decisions += timed(decide, repeats, budget_s / 2)
        reports += timed(lambda: report(registry, history, WINDOW_S), max(3, repeats // 4), budget_s / 2)
    out.update(decision=timing(decisions), report=timing(reports), parse=timing(parses), splits=splits,
               samples_per_worker=int(WINDOW_S / EVERY_S) + 1)
    return out


def pd_router(n: int, prefill_policy: str) -> tuple[Router, PDPlanner]:
    """A pd-mode Router of ``n`` prefills and ``n`` decodes, all known and healthy (no sockets)."""
    config = RouterConfig(prefill=tuple(f"http://127.0.0.1:{20000 + i}" for i in range(n)),
                          decode=tuple(f"http://127.0.0.1:{30000 + i}" for i in range(n)),
                          policy_prefill=prefill_policy, policy_decode="least_load")
    router = Router(config)
    for i, w in enumerate(router.registry):
        w.known, w.healthy, w.models, w.fingerprint = True, True, (MODEL,), dict(FP)
        w.limits = {"max_body_bytes": 64 << 20, "max_images_per_request": 16}
        w.outstanding = i % 3
        if w.role == "prefill":
            w.bootstrap = ("127.0.0.1", 40000 + i)
    planner = PDPlanner(router.registry.pools["prefill"], router.registry.pools["decode"], router.pairing)
    return router, planner


def hot_path(n: int, repeats: int, budget_s: float) -> dict:
    """Per-request reads of the workers on a pd Router of ``n`` per role, each alone (microseconds)."""
    import msgspec

    body = msgspec.json.decode(BODY)
    out: dict = {"n": n}
    router, _ = pd_router(n, "round_robin")
    out["stage_limits"] = timing(timed(router.stage_limits, repeats, budget_s / 6))
    out["serves"] = timing(timed(lambda: router.serves(MODEL), repeats, budget_s / 6))
    out["video_support"] = timing(timed(router.video_support, repeats, budget_s / 6))
    loop = asyncio.new_event_loop()
    try:
        for policy in ("round_robin", "least_load", "prefix_aware"):
            _, planner = pd_router(n, policy)

            def plan() -> None:
                call = Call(body, False, MODEL, time.perf_counter(), raw=BODY)
                coro = planner.plan(call, ())
                try:
                    coro.send(None)  # the pd planner awaits nothing: it returns at the first step
                except StopIteration:
                    return
                raise RuntimeError("the pd planner awaited")

            out[f"plan_{policy}"] = timing(timed(plan, repeats, budget_s / 6))
    finally:
        loop.close()
    return out


@pytest.mark.parametrize("n", [8])
def test_the_in_process_measures_run_and_the_planner_follows_the_phases(n):
    p = planner(n, 5, 1.0)
    assert p["decision"]["n"] >= 3 and p["parse"]["n"] == 3 * n * 2 * p["samples_per_worker"]
    assert p["splits"]["image_heavy"]["encoder"] > p["splits"]["text_only"]["encoder"]
    h = hot_path(n, 5, 1.0)
    assert all(h[k]["n"] >= 3 for k in ("stage_limits", "serves", "video_support", "plan_round_robin",
                                         "plan_least_load", "plan_prefix_aware"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="bench.fleet_scale's in-process measures, as JSON")
    p.add_argument("--sizes", default="8,64,256")
    p.add_argument("--repeats", type=int, default=400)
    p.add_argument("--budget-s", type=float, default=6.0)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    out = {}
    for n in (int(s) for s in args.sizes.split(",") if s):
        out[n] = {"planner": planner(n, args.repeats, args.budget_s), "hot_path": hot_path(n, args.repeats, args.budget_s)}
        print(f"N={n}: decision {out[n]['planner']['decision']}, plan rr {out[n]['hot_path']['plan_round_robin']}",
              flush=True)
    with open(args.out, "w") as f:
        json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
