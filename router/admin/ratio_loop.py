"""``GET /admin/ratio``'s report and the automatic ratio loop (``--auto-ratio-interval-s``).

The report reads the load history (``router.fleet.load``) over the window asked for (at most
``--ratio-window-s``): per role its workers, utilization, queue depth, demand and measured capacity;
the demand as images/s, prefill tokens/s and decode tokens/s; the mean TTFT and TPOT the router saw;
the recommended E:P:D split for the current pool (``router.plan.ratio.recommend``) and the split
``POST /admin/ratio`` would apply to get closest to it (``apply``): E:P:D when a switchable worker can
be an encoder (``split_roles``), else P:D with the encoders fixed.

The loop, every interval: sample, and let ``router.plan.ratio.decide_tick`` (``apply`` and
``Hysteresis``) decide whether to switch workers now (``Membership.apply_split``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Mapping

from router.errors import RouterError
from router.fleet.load import History, role_loads
from router.fleet.membership import Membership
from router.fleet.splits import movable_of
from router.plan.ratio import ORDER, Hysteresis, Movable, RoleLoad, decide_tick, recommend, target_split
from router.fleet.registry import Registry

log = logging.getLogger(__name__)


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


def split_roles(registry: Registry, allowed: Collection[str] = ORDER) -> tuple[str, ...]:
    """The roles switching moves workers between: encoder, prefill and decode when the router has
    encoders, ``allowed`` names the encoder (``--auto-ratio-roles``, for the loop) and a switchable
    worker (in any pool) can take the role encoder; else prefill and decode (the encoders fixed);
    none in colocated mode."""
    if "prefill" not in registry.pools:
        return ()
    epd = "encoder" in registry.pools and "encoder" in allowed and \
        any("encoder" in w.roles for w in registry if w.switchable)
    return ORDER if epd else ("prefill", "decode")


def movable(registry: Registry, allowed: Collection[str] = ORDER) -> Movable:
    """The workers of ``split_roles`` in numbers."""
    return movable_of({role: registry.pools[role].workers for role in split_roles(registry, allowed)})


def apply_target(registry: Registry, loads: list[RoleLoad]) -> dict[str, int] | None:
    """The split of ``split_roles`` closest to the recommendation that switching can reach, or None."""
    return target_split(movable(registry), loads)


async def auto_ratio_loop(membership: Membership, history: History, sample: Callable[[], Awaitable[object]],
                          interval_s: float, window_s: float, roles: Collection[str] = ORDER) -> None:
    """Forever: every ``interval_s``, ``sample`` the workers into ``history`` and apply the recommended
    split of ``split_roles`` among ``roles`` (``--auto-ratio-roles``; over the last ``window_s``) when
    ``decide_tick`` says so."""
    hysteresis = Hysteresis()
    while True:
        await asyncio.sleep(interval_s)
        await sample()
        pool = movable(membership.registry, roles)
        loads, _ = role_loads(history, time.monotonic(), window_s, pool.current, pool.roles)
        target = decide_tick(pool, loads, hysteresis)
        if target is None:
            continue
        log.info("auto ratio: applying %s %s (was %s)", ":".join(pool.roles), _split(target), _split(pool.current))
        try:
            await membership.apply_split(target)
        except RouterError as exc:
            log.warning("auto ratio: could not apply %s: %s", target, exc.message)


def _split(split: Mapping[str, int]) -> str:
    return ":".join(str(n) for n in split.values())


def _mean(history: History, now: float, window_s: float, name: str) -> float | None:
    count = history.router_increase(now, window_s, f"{name}_count")
    return history.router_increase(now, window_s, f"{name}_sum") / count if count else None
