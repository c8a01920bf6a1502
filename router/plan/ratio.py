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


def clamp_split(target: Mapping[str, int], fixed: Mapping[str, int], total: int) -> dict[str, int]:
    """A prefill:decode ``target`` made reachable: only switchable workers move, so each role keeps at
    least its ``fixed`` (not switchable) workers, and the two add up to ``total``."""
    prefill = min(max(target["prefill"], fixed.get("prefill", 0)), total - fixed.get("decode", 0))
    return {"prefill": prefill, "decode": total - prefill}


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


def _rank(role: str) -> int:
    return ORDER.index(role) if role in ORDER else len(ORDER)
