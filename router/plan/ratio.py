"""The recommended E:P:D split and when to apply it. Pure: numbers in, numbers out.

For each role r, over the sliding window (``router.fleet.load``):

    demand_r    units of work per second the traffic asked for: images and video frames /s (E), prompt tokens
                prefilled per second (P), tokens decoded per second (D)
    capacity_r  units one worker of r does per second of its own busy time (its engine steps,
                or the encoder's vision-tower calls): sum of units / sum of busy seconds, over
                the role's workers
    need_r      demand_r / capacity_r: how many workers' worth of busy time the traffic needs

The split of N workers gives role r ``N * need_r / sum(need)`` workers, rounded by largest
remainder, with at least one worker for every role in the split. A role whose workers were never
busy in the window (e.g. decodes asked for one token, which the prefill makes) needs no worker's
time: it keeps its minimum of one.
``docs/admin.md`` shows the formula with an example.

What switching can reach (``Movable``, ``clamp_split``, ``target_split``) and when the automatic
loop switches (``Hysteresis``, ``decide_tick``) are here too, on counts of workers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

ORDER = ("encoder", "prefill", "decode")


@dataclass(frozen=True)
class RoleLoad:
    role: str
    workers: int  # in the pool now
    demand: float  # units per second over the window
    capacity: float | None  # units per busy second of one worker; None: no busy time measured

    @property
    def need(self) -> float:
        """Workers' worth of busy time the demand takes (none when no busy time was measured)."""
        return self.demand / self.capacity if self.capacity else 0.0


def recommend(loads: list[RoleLoad], pool_size: int) -> dict[str, int] | None:
    """Workers per role for ``pool_size`` workers in all, each role of ``loads`` at least one; None
    when there is no demand to go by or fewer workers than roles."""
    needs = {load.role: load.need for load in loads}
    total = sum(needs.values())
    if total <= 0 or pool_size < len(loads):
        return None
    quota = {role: pool_size * need / total for role, need in needs.items()}
    split = {role: max(1, math.floor(q)) for role, q in quota.items()}
    while sum(split.values()) > pool_size:  # the minimum of one pushed it over: take from the most over quota
        role = max((r for r in split if split[r] > 1), key=lambda r: (split[r] - quota[r], -_rank(r)))
        split[role] -= 1
    while sum(split.values()) < pool_size:  # largest remainder first
        role = max(split, key=lambda r: (quota[r] - split[r], -_rank(r)))
        split[role] += 1
    return split


def peak_load(needs: Mapping[str, float], split: Mapping[str, int]) -> float:
    """The busiest role's need per worker under ``split`` (1.0: its workers busy all the time)."""
    return max((need / split[role] for role, need in needs.items() if split.get(role)), default=0.0)


@dataclass(frozen=True)
class Movable:
    """The roles a split moves workers between, in numbers (in ``ORDER``): per role its workers now
    (``current``), those that cannot leave it (``fixed``: not switchable) and the most it can have
    (``most``: its fixed workers and every switchable worker of these roles, wherever it serves now,
    that can take it). Every switchable worker takes prefill and decode, so within these bounds every
    split with the same total is reachable."""

    current: Mapping[str, int]
    fixed: Mapping[str, int]
    most: Mapping[str, int]

    @property
    def roles(self) -> tuple[str, ...]:
        return tuple(self.current)


def clamp_split(target: Mapping[str, int], fixed: Mapping[str, int],
                most: Mapping[str, int] | None = None) -> dict[str, int]:
    """``target`` made reachable by switching: each role between its ``fixed`` workers and its ``most``
    (default: no bound), the same total. Roles pushed over by a bound give back from the one furthest
    over its target, roles short take from the one furthest under it (ties: E, P, D order)."""
    total, most = sum(target.values()), most or {}
    low = {role: fixed.get(role, 0) for role in target}
    high = {role: most.get(role, total) for role in target}
    split = {role: min(max(n, low[role]), high[role]) for role, n in target.items()}
    while sum(split.values()) > total:
        role = max((r for r in split if split[r] > low[r]), key=lambda r: (split[r] - target[r], -_rank(r)))
        split[role] -= 1
    while sum(split.values()) < total:
        role = max((r for r in split if split[r] < high[r]), key=lambda r: (target[r] - split[r], -_rank(r)))
        split[role] += 1
    return split


def target_split(movable: Movable, loads: list[RoleLoad]) -> dict[str, int] | None:
    """The split of ``movable``'s roles closest to the recommendation (``recommend`` over their
    ``loads``) that switching can reach, or None when there is no recommendation."""
    moved = [load for load in loads if load.role in movable.current]
    if len(moved) != len(movable.roles) or len(moved) < 2:
        return None
    target = recommend(moved, sum(movable.current.values()))
    return None if target is None else clamp_split(target, movable.fixed, movable.most)


@dataclass
class Hysteresis:
    """When the automatic ratio loop applies a recommendation: the same target must come up
    ``stable_ticks`` times in a row, and it must lower the busiest role's load per worker by at
    least ``min_gain`` (a fraction) compared with the current split. So a split never flips back
    and forth on noise, and a switch (which costs a drain) is made only when it pays."""

    stable_ticks: int = 2
    min_gain: float = 0.2
    _last: dict[str, int] | None = None
    _streak: int = 0

    def decide(self, current: Mapping[str, int], target: Mapping[str, int] | None,
               needs: Mapping[str, float]) -> bool:
        """Called once per tick with the current split and this tick's target; True: apply it now."""
        if target is None or dict(target) == dict(current):
            self._last, self._streak = None, 0
            return False
        self._streak = self._streak + 1 if self._last == dict(target) else 1
        self._last = dict(target)
        if self._streak < self.stable_ticks:
            return False
        if peak_load(needs, target) > peak_load(needs, current) * (1 - self.min_gain):
            return False
        self._last, self._streak = None, 0
        return True


def decide_tick(movable: Movable, loads: list[RoleLoad], hysteresis: Hysteresis) -> dict[str, int] | None:
    """One tick of the automatic ratio loop: the split to apply now (``target_split``, once
    ``hysteresis`` agrees), or None. Pure but for ``hysteresis``'s streak."""
    target = target_split(movable, loads)
    needs = {load.role: load.need for load in loads if load.role in movable.current}
    return target if hysteresis.decide(movable.current, target, needs) else None


def _rank(role: str) -> int:
    return ORDER.index(role) if role in ORDER else len(ORDER)
