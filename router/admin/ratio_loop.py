"""``GET /admin/ratio``'s report and the automatic ratio loop (``--auto-ratio-interval-s``).

The report reads the load history (``router.fleet.load``) over the window asked for (at most
``--ratio-window-s``): per role its workers, utilization, queue depth, demand and measured capacity;
the demand as images/s, prefill tokens/s and decode tokens/s; the mean TTFT and TPOT the router saw;
the recommended E:P:D split for the current pool (``router.plan.ratio.recommend``) and the prefill:decode
split ``POST /admin/ratio`` would apply to get closest to it (``apply``).

The loop, every interval: sample, compute ``apply``, and let ``Hysteresis`` decide whether to
switch workers now (``Membership.apply_split``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from router.errors import RouterError
from router.fleet.load import History, role_loads
from router.fleet.membership import Membership
from router.plan.ratio import ORDER, Hysteresis, RoleLoad, clamp_split, recommend
from router.fleet.registry import Registry

log = logging.getLogger(__name__)
SPLIT_ROLES = ("prefill", "decode")


def report(registry: Registry, history: History, window_s: float) -> dict:
    """The ``GET /admin/ratio`` body over the last ``window_s`` of ``history`` (sampled by the caller)."""
    now = time.monotonic()
    pools = {role: registry.pools[role].workers for role in ORDER if role in registry.pools}
    roles = list(pools)
    workers = {role: len(members) for role, members in pools.items()}
    loads, per_role = role_loads(history, now, window_s, workers, roles)
    for role in roles:
        latest = [history.latest(w.id) for w in pools[role]]
        per_role[role]["queue_depth"] = sum(s.queue_depth for s in latest if s is not None and s.role == role)
        per_role[role]["switchable"] = sum(w.switchable for w in pools[role])
    span = history.span(now, window_s)
    per_s = (lambda role: per_role[role]["demand_per_s"] if role in per_role else 0.0)
    body = {
        "window_s": window_s, "measured_s": span, "roles": per_role,
        "demand": {"images_per_s": history.router_increase(now, window_s, "images") / span if span else 0.0,
                   "prefill_tokens_per_s": per_s("prefill"), "decode_tokens_per_s": per_s("decode")},
        "ttft_s": _mean(history, now, window_s, "ttft"), "tpot_s": _mean(history, now, window_s, "tpot"),
        "current": workers, "recommended": recommend(loads, sum(workers.values())) if loads else None,
        "apply": apply_target(registry, loads),
    }
    if body["recommended"] is None:
        body["reason"] = ("colocated mode has one role" if not loads else
                          "no work measured in the window yet" if sum(load.need for load in loads) <= 0 else
                          "fewer workers than roles")
    return body


def apply_target(registry: Registry, loads: list[RoleLoad]) -> dict[str, int] | None:
    """The prefill:decode split closest to the recommendation that switching can reach, or None."""
    split_loads = [load for load in loads if load.role in SPLIT_ROLES]
    if len(split_loads) != 2:
        return None
    pools = {role: registry.pools[role].workers for role in SPLIT_ROLES}
    total = sum(len(pools[role]) for role in SPLIT_ROLES)
    target = recommend(split_loads, total)
    if target is None:
        return None
    fixed = {role: sum(not w.switchable for w in pools[role]) for role in SPLIT_ROLES}
    return clamp_split(target, fixed, total)


async def auto_ratio_loop(membership: Membership, history: History, sample: Callable[[], Awaitable[object]],
                          interval_s: float, window_s: float) -> None:
    """Forever: every ``interval_s``, ``sample`` the workers into ``history`` and apply the recommended
    prefill:decode split (over the last ``window_s``) when ``Hysteresis`` says so."""
    hysteresis, registry = Hysteresis(), membership.registry
    while True:
        await asyncio.sleep(interval_s)
        await sample()
        now = time.monotonic()
        current = {role: len(registry.pools[role].workers) for role in SPLIT_ROLES}
        loads, _ = role_loads(history, now, window_s, current, SPLIT_ROLES)
        target = apply_target(registry, loads)
        if not hysteresis.decide(current, target, {load.role: load.need for load in loads}):
            continue
        assert target is not None
        log.info("auto ratio: applying prefill:decode %d:%d (was %d:%d)", target["prefill"], target["decode"],
                 current["prefill"], current["decode"])
        try:
            await membership.apply_split(target["prefill"], target["decode"])
        except RouterError as exc:
            log.warning("auto ratio: could not apply %s: %s", target, exc.message)


def _mean(history: History, now: float, window_s: float, name: str) -> float | None:
    count = history.router_increase(now, window_s, f"{name}_count")
    return history.router_increase(now, window_s, f"{name}_sum") / count if count else None
