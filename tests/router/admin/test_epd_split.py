"""E:P:D tuned as one (issue 34), the pure parts: which splits switching can reach when some switchable
workers can be encoders (``clamp_split``, ``check_split``, ``target_split``), who moves (``movers``,
``check_switch``, ``Membership.apply_split`` with its switches recorded instead of made), which roles
the loop moves (``split_roles``), and the automatic loop's step (``decide_tick``) driven by recorded
load samples as the sampler writes them (``router.fleet.load``); ``stage admin ratio --apply E:P:D`` and
``stage admin role``. No sockets."""

from __future__ import annotations

import argparse
import random

import pytest

from cli.admin import _request, add_admin_args, render
from router.admin.ratio_loop import apply_target, movable, split_roles
from router.config import RouterConfig
from router.errors import RouterError
from router.fleet.breaker import CircuitBreaker
from router.fleet.load import History, Sample, role_loads
from router.fleet.membership import Membership
from router.fleet.splits import check_split, check_switch, movable_of, movers
from router.fleet.pairing import Pairing
from router.fleet.registry import Registry
from router.fleet.workers import Worker
from router.metrics import Metrics
from router.plan.policy import RoundRobin
from router.plan.ratio import ORDER, Hysteresis, Movable, RoleLoad, clamp_split, decide_tick, recommend, target_split
from router.upstream.client import Upstream

pytestmark = pytest.mark.unit

EPD, PD = ("encoder", "prefill", "decode"), ("prefill", "decode")


def worker(name: str, role: str, roles: tuple[str, ...] = (), outstanding: int = 0) -> Worker:
    """A known, healthy worker named ``name``; switchable when it has ``roles``."""
    return Worker(f"http://{name}:1", role, CircuitBreaker(1, 10.0), healthy=True, known=True, models=("m",),
                  fingerprint={"model": "m"}, switchable=bool(roles), roles=roles, outstanding=outstanding, id=name,
                  vision_fingerprint="vf" if role == "encoder" else None)


def pools_of(*workers: Worker, roles: tuple[str, ...] = EPD) -> dict[str, list[Worker]]:
    return {role: [w for w in workers if w.role == role] for role in roles}


def registry_of(*workers: Worker, mode: str = "epd") -> Registry:
    roles = EPD if mode == "epd" else PD
    registry = Registry(mode, {role: RoundRobin() for role in roles}, Metrics(), lambda: CircuitBreaker(1, 10.0))
    for w in workers:
        registry.add(w)
        w.id = w.url.split("//")[1].split(":")[0]  # keep the test's names
    return registry


# --- reachable splits --------------------------------------------------------------------------
def test_clamp_split_keeps_fixed_workers_and_caps_what_can_take_a_role():
    fixed, most = {"encoder": 1, "prefill": 1, "decode": 1}, {"encoder": 2, "prefill": 4, "decode": 4}
    # the recommendation wants 4 encoders, only 2 can be: the rest go to the roles furthest under target
    assert clamp_split({"encoder": 4, "prefill": 1, "decode": 1}, fixed, most) == {"encoder": 2, "prefill": 2,
                                                                                    "decode": 2}
    assert clamp_split({"encoder": 1, "prefill": 4, "decode": 1}, fixed, most) == {"encoder": 1, "prefill": 4,
                                                                                    "decode": 1}
    assert clamp_split({"encoder": 1, "prefill": 1, "decode": 5}, {"encoder": 2}, most) == {"encoder": 2, "prefill": 1,
                                                                                             "decode": 4}
    # deterministic: ties go E, P, D
    assert clamp_split({"encoder": 3, "prefill": 2, "decode": 2}, fixed, most) == {"encoder": 2, "prefill": 3,
                                                                                    "decode": 2}


def test_target_split_over_three_roles_moves_only_what_can_move():
    # E 2 fixed and 1 switchable that can be an encoder: 4:1:1 recommended, 3 encoders at most, the sixth worker to
    # the role furthest under its target (a tie: prefill before decode)
    m = Movable(current={"encoder": 2, "prefill": 2, "decode": 2}, fixed={"encoder": 2, "prefill": 0, "decode": 1},
                most={"encoder": 3, "prefill": 3, "decode": 4})
    loads = [RoleLoad("encoder", 2, 400, 100), RoleLoad("prefill", 2, 100, 100), RoleLoad("decode", 2, 100, 100)]
    assert recommend(loads, 6) == {"encoder": 4, "prefill": 1, "decode": 1}
    assert target_split(m, loads) == {"encoder": 3, "prefill": 2, "decode": 1}
    # a P:D split (the encoders fixed) ignores the encoder's load
    pd = Movable(current={"prefill": 2, "decode": 2}, fixed={"prefill": 1, "decode": 0}, most={"prefill": 4,
                                                                                              "decode": 3})
    assert target_split(pd, loads) == {"prefill": 2, "decode": 2}
    assert target_split(pd, [RoleLoad("prefill", 2, 0, None), RoleLoad("decode", 2, 0, None)]) is None


def test_movable_counts_what_each_role_can_reach():
    workers = [worker("e1", "encoder"), worker("x", "prefill", EPD), worker("y", "decode", PD),
               worker("p1", "prefill"), worker("d1", "decode")]
    m = movable_of(pools_of(*workers))
    assert (m.current, m.fixed, m.most) == ({"encoder": 1, "prefill": 2, "decode": 2},
                                            {"encoder": 1, "prefill": 1, "decode": 1},
                                            {"encoder": 2, "prefill": 3, "decode": 3})


def test_check_split_over_three_roles():
    workers = [worker("e1", "encoder"), worker("x", "prefill", EPD), worker("y", "decode", PD),
               worker("p1", "prefill"), worker("d1", "decode")]
    pools = pools_of(*workers)
    assert check_split({"encoder": 2, "prefill": 1, "decode": 2}, pools) == {"encoder": 2, "prefill": 1, "decode": 2}
    check_split({"encoder": 1, "prefill": 3, "decode": 1}, pools)
    for split, status, message in [
        ({"encoder": 0, "prefill": 3, "decode": 2}, 400,
         'a split is {"encoder": e, "prefill": n, "decode": m}, each an integer >= 1'),
        ({"encoder": 1.0, "prefill": 2, "decode": 2}, 400,
         'a split is {"encoder": e, "prefill": n, "decode": m}, each an integer >= 1'),
        ({"encoder": 1, "prefill": 2}, 400, 'a split is {"encoder": e, "prefill": n, "decode": m}, each an integer >= 1'),
        ({"encoder": 1, "prefill": 2, "decode": 3}, 400,
         "the pool has 5 encoder, prefill and decode workers; encoder + prefill + decode must be 5, got 1 + 2 + 3"),
        ({"encoder": 3, "prefill": 1, "decode": 1}, 409,
         "at most 2 workers can serve as encoder: 1 fixed and 1 switchable that can take the role (an EPD switchable "
         "worker, stage serve pd --redis-url, can be an encoder)"),
    ]:
        with pytest.raises(RouterError) as error:
            check_split(split, pools)
        assert (error.value.status, error.value.code, error.value.message) == (
            status, "invalid_split" if status == 400 else "split_unreachable", message)
    fixed = pools_of(worker("e1", "encoder"), worker("e2", "encoder"), worker("p1", "prefill"),
                     worker("x", "decode", EPD))
    with pytest.raises(RouterError) as error:
        check_split({"encoder": 1, "prefill": 1, "decode": 2}, fixed)
    assert (error.value.status, error.value.message) == (
        409, "only switchable workers (stage serve pd) change roles: 2 encoder, 1 prefill and 0 decode workers are "
        "fixed, so encoder must be >= 2, prefill >= 1 and decode >= 0")


# --- who moves ---------------------------------------------------------------------------------
def test_movers_pick_the_least_loaded_that_can_take_the_role():
    x1, x2 = worker("x1", "decode", EPD, outstanding=3), worker("x2", "decode", EPD, outstanding=1)
    y = worker("y", "decode", PD, outstanding=0)  # the least loaded, but it cannot be an encoder
    pools = pools_of(worker("e1", "encoder"), worker("p1", "prefill"), x1, x2, y)
    assert [(w.id, to) for w, to in movers({"encoder": 2, "prefill": 1, "decode": 2}, pools)] == [("x2", "encoder")]
    # the encoder is served first (fewer can take it), then the prefill takes the least loaded left
    assert [(w.id, to) for w, to in movers({"encoder": 2, "prefill": 2, "decode": 1}, pools)] == [
        ("x2", "encoder"), ("y", "prefill")]
    x2.draining = True  # an operator drained it: never moved
    assert [(w.id, to) for w, to in movers({"encoder": 2, "prefill": 1, "decode": 2}, pools)] == [("x1", "encoder")]
    x1.draining = True
    with pytest.raises(RouterError) as error:
        movers({"encoder": 2, "prefill": 1, "decode": 2}, pools)
    assert (error.value.status, error.value.message) == (
        409, "1 worker(s) must switch to encoder, but only 0 switchable worker(s) not drained can take it")


def test_an_encoder_switchable_moves_straight_to_the_role_that_grows():
    x = worker("x", "encoder", EPD)
    pools = pools_of(worker("e1", "encoder"), x, worker("p1", "prefill"), worker("d1", "decode"))
    assert [(w.id, to) for w, to in movers({"encoder": 1, "prefill": 1, "decode": 2}, pools)] == [("x", "decode")]


def membership_of(registry: Registry) -> tuple[Membership, list[tuple[str, str]]]:
    """A membership over ``registry`` whose switches are recorded (worker id, role), not made."""
    config = RouterConfig(prefill=("http://p:1",), decode=("http://d:1",))
    membership = Membership(config, registry, Upstream(config), Pairing(), _no_schema)
    made: list[tuple[str, str]] = []

    async def switch(w: Worker, role: str) -> dict:
        made.append((w.id, role))
        return {"id": w.id, "from": w.role, "to": role}

    membership.switch = switch  # type: ignore[method-assign]
    return membership, made


async def _no_schema(workers: list[Worker]) -> None:
    pass


async def test_apply_split_moves_encoders_only_when_asked():
    x = worker("x", "prefill", EPD)
    registry = registry_of(worker("e1", "encoder"), x, worker("p1", "prefill"), worker("d1", "decode"))
    membership, made = membership_of(registry)
    assert await membership.apply_split({"prefill": 1, "decode": 2}) == [{"id": "x", "from": "prefill",
                                                                          "to": "decode"}]
    assert await membership.apply_split({"encoder": 2, "prefill": 1, "decode": 1}) == [
        {"id": "x", "from": "prefill", "to": "encoder"}]
    assert made == [("x", "decode"), ("x", "encoder")]
    with pytest.raises(RouterError) as error:  # the prefill:decode split counts no encoder
        await membership.apply_split({"prefill": 2, "decode": 2})
    assert error.value.message == "the pool has 3 prefill and decode workers; prefill + decode must be 3, got 2 + 2"


def test_one_worker_switches_only_to_a_role_it_can_take_and_never_empties_a_role():
    x, y = worker("x", "prefill", EPD), worker("y", "decode", PD)
    e1, p1 = worker("e1", "encoder"), worker("p1", "prefill")
    registry = registry_of(e1, x, y, p1)
    assert check_switch(x, "encoder", registry.pools) == "encoder"
    assert check_switch(x, "prefill", registry.pools) is None
    for w, role, status, code, message in [
        (x, "colocated", 400, "invalid_role", "role must be one of encoder, prefill, decode, got 'colocated'"),
        (x, None, 400, "invalid_role", "role must be one of encoder, prefill, decode, got None"),
        (p1, "decode", 409, "worker_not_switchable",
         "p1 (prefill http://p1:1) is not a switchable worker (stage serve pd): it keeps its role"),
        (y, "encoder", 400, "invalid_role", "y can take the roles prefill, decode, not encoder (an EPD switchable "
         "worker, stage serve pd --redis-url, can be an encoder)"),
        (y, "prefill", 409, "split_unreachable", "y is the only decode worker: switching it would leave none"),
    ]:
        with pytest.raises(RouterError) as error:
            check_switch(w, role, registry.pools)
        assert (error.value.status, error.value.code, error.value.message) == (status, code, message)
    x.draining = True
    with pytest.raises(RouterError) as error:
        check_switch(x, "encoder", registry.pools)
    assert (error.value.status, error.value.code) == (409, "worker_busy")


# --- which roles the loop moves ----------------------------------------------------------------
def test_the_encoder_is_in_the_split_only_when_a_switchable_worker_can_be_one():
    pd_only = registry_of(worker("e1", "encoder"), worker("x", "prefill", PD), worker("d1", "decode"))
    assert split_roles(pd_only) == PD
    epd = registry_of(worker("e1", "encoder"), worker("x", "decode", EPD), worker("p1", "prefill"),
                      worker("d1", "decode"))
    assert split_roles(epd) == EPD
    assert split_roles(epd, allowed=PD) == PD  # --auto-ratio-roles prefill,decode: the encoders stay
    assert split_roles(registry_of(worker("x", "prefill", EPD), worker("d1", "decode"), mode="pd")) == PD
    loads = [RoleLoad("encoder", 1, 300, 100), RoleLoad("prefill", 1, 100, 100), RoleLoad("decode", 2, 50, 100)]
    assert apply_target(epd, loads) == {"encoder": 2, "prefill": 1, "decode": 1}
    assert apply_target(pd_only, loads) == {"prefill": 1, "decode": 1}


# --- the loop, on recorded load ----------------------------------------------------------------
CAPACITY = {"encoder": 100.0, "prefill": 4000.0, "decode": 200.0}  # units per busy second of one worker
IMAGES = {"encoder": 1.6, "prefill": 0.5, "decode": 0.5}  # workers' worth of busy time the traffic asks for
TEXT = {"encoder": 0.0, "prefill": 1.5, "decode": 0.5}


class Recorded:
    """A fleet under a given traffic, recorded as the sampler records it: every tick (a second) each
    worker's cumulative busy seconds and units of its role, one ``Sample`` each, into a ``History``. A
    role's workers share its load, each busy at most all the time (a saturated role shows the need of
    its workers, not the traffic's). Noise: each worker's tick within +-3%."""

    def __init__(self, registry: Registry, window_s: float) -> None:
        self.registry, self.window_s = registry, window_s
        self.history = History(window_s)
        self.counters: dict[tuple[str, str], tuple[float, float]] = {}  # (worker id, role) -> (busy_s, units)
        self.noise = random.Random(34)
        self.now = 0.0

    def tick(self, traffic: dict[str, float]) -> None:
        self.now += 1.0
        for role, pool in self.registry.pools.items():
            for w in pool.workers:
                busy = min(1.0, traffic[role] / len(pool.workers)) * self.noise.uniform(0.97, 1.03)
                busy_s, units = self.counters.get((w.id, role), (0.0, 0.0))
                self.counters[w.id, role] = (busy_s + busy, units + busy * CAPACITY[role])
                self.history.add(w.id, Sample(self.now, role, busy_s + busy, units + busy * CAPACITY[role], 0, 0,
                                              None))
        self.history.add_router(self.now, {})

    def decide(self, hysteresis: Hysteresis) -> dict[str, int] | None:
        """What the loop decides this tick (``auto_ratio_loop`` less the sleep, the scrape and the switches)."""
        pool = movable(self.registry)
        loads, _ = role_loads(self.history, self.now, self.window_s, pool.current, pool.roles)
        return decide_tick(pool, loads, hysteresis)

    def switch(self, target: dict[str, int]) -> list[tuple[str, str, str]]:
        """Make the switches ``movers`` picks, in memory."""
        pools = {role: self.registry.pools[role].workers for role in target}
        made = []
        for w, role in movers(target, pools):
            made.append((w.id, w.role, role))
            self.registry.begin_switch(w)
            self.registry.move(w, role)
            self.registry.end_switch(w)
        return made


def test_the_loop_moves_the_encoder_with_the_traffic_and_holds_on_steady_load():
    x = worker("x", "prefill", EPD)  # an EPD switchable worker, serving as a second prefill
    registry = registry_of(worker("e1", "encoder"), x, worker("p1", "prefill"), worker("d1", "decode"))
    fleet, hysteresis = Recorded(registry, window_s=4.0), Hysteresis(stable_ticks=2, min_gain=0.2)
    switches: list[tuple[int, str, str, str]] = []
    phases = [(IMAGES, 30), (TEXT, 30), (IMAGES, 30)]
    tick = 0
    for traffic, ticks in phases:
        for _ in range(ticks):
            tick += 1
            fleet.tick(traffic)
            target = fleet.decide(hysteresis)
            if target is not None:
                switches += [(tick, *made) for made in fleet.switch(target)]
    assert [s[1:] for s in switches] == [("x", "prefill", "encoder"), ("x", "encoder", "prefill"),
                                         ("x", "prefill", "encoder")]
    settle, to_text, back = (s[0] for s in switches)
    assert settle <= 3  # the encoder saturated from the start: the same target twice, then the switch
    # the text-only window must fill and the target hold for stable_ticks: never at once, never long after
    assert 30 + hysteresis.stable_ticks <= to_text <= 30 + 4 + hysteresis.stable_ticks
    assert 60 + hysteresis.stable_ticks <= back <= 60 + 4 + hysteresis.stable_ticks
    assert x.role == "encoder" and [len(registry.pools[r].workers) for r in ORDER] == [2, 1, 1]


# --- stage admin -------------------------------------------------------------------------------
def admin_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_admin_args(parser)
    return parser.parse_args(list(argv))


def test_stage_admin_applies_e_p_d_or_p_d_and_switches_one_worker():
    assert _request(admin_args("ratio", "--apply", "2:3:3")) == (
        "POST", "/admin/ratio", {"encoder": 2, "prefill": 3, "decode": 3})
    assert _request(admin_args("ratio", "--apply", "3:5")) == ("POST", "/admin/ratio", {"prefill": 3, "decode": 5})
    for bad in ("3", "1:2:3:4", "a:b", "3:-1", "²:1"):
        with pytest.raises(ValueError):
            _request(admin_args("ratio", "--apply", bad))
    assert _request(admin_args("role", "w3", "encoder")) == ("POST", "/admin/workers/w3/role", {"role": "encoder"})
    applied = {"encoder": 2, "prefill": 1, "decode": 1,
               "switched": [{"id": "w2", "from": "prefill", "to": "encoder", "seconds": 1.234, "dial": {}}]}
    assert render(admin_args("ratio", "--apply", "2:1:1"), applied) == (
        "encoder/prefill/decode now 2:1:1\n  w2: prefill -> encoder in 1.23 s")
    worker_view = {"id": "w2", "role": "encoder", "url": "http://x:1"}
    assert render(admin_args("role", "w2", "encoder"), {"worker": worker_view, "switched": applied["switched"][0]}) == \
        "w2 (encoder http://x:1): switched from prefill in 1.23 s"
    assert render(admin_args("role", "w2", "encoder"), {"worker": worker_view, "switched": None}) == \
        "w2 (encoder http://x:1): serves that role already"
