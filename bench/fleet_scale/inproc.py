"""``bench.fleet_scale``'s two in-process measures at N workers per role (the package docstring says
what each times): ``planner`` (the ratio planner over a filled ``History``, the whole ``/admin/ratio``
report, one scrape's parse) and ``hot_path`` (what a pd-mode ``Router`` does per request that reads its
workers). No sockets: the router's own objects, as ``router.runtime.Router`` builds them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from bench.fleet_scale.analysis import timing
from bench.fleet_scale.load import MODEL, ROLES, metrics_text
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
