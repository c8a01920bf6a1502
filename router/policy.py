"""Which worker of a role gets the next request. Pure: no I/O, no clock.

A policy chooses among candidates the caller has already filtered (healthy, circuit allows,
compatible, not excluded). ``choose`` is called once per pick, on the event loop; it may update
the policy's own cursor but never the candidates.

    round_robin   each candidate in turn
    least_load    fewest outstanding requests; ties go round robin (so equal loads alternate)
    cache_aware   encoders: consistent hashing on the image key, so the same image goes to the same
                  encoder while the set of candidates stays the same, and only 1/N of the keys move
                  when a candidate leaves or joins; without a key, least_load
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

VIRTUAL_NODES = 64  # points per candidate on the hash ring; more points, more even spread


class Candidate(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def outstanding(self) -> int: ...


C = TypeVar("C", bound=Candidate)  # a policy hands back one of the candidates it was given, as given


class Policy(Protocol):
    def choose(self, candidates: Sequence[C], key: str | None = None) -> C:
        """One of ``candidates`` (non-empty). ``key``: the image key, for cache_aware."""
        ...


class RoundRobin:
    def __init__(self) -> None:
        self._turn = 0

    def choose(self, candidates: Sequence[C], key: str | None = None) -> C:
        _check(candidates)
        chosen = candidates[self._turn % len(candidates)]
        self._turn += 1
        return chosen


class LeastLoad:
    def __init__(self) -> None:
        self._turn = 0

    def choose(self, candidates: Sequence[C], key: str | None = None) -> C:
        _check(candidates)
        start = self._turn % len(candidates)
        self._turn += 1
        rotated = [*candidates[start:], *candidates[:start]]
        return min(rotated, key=lambda c: c.outstanding)  # min keeps the first of equals


class CacheAware:
    def __init__(self, virtual_nodes: int = VIRTUAL_NODES) -> None:
        self._virtual_nodes = virtual_nodes
        self._fallback = LeastLoad()
        self._ring_of: frozenset[str] = frozenset()
        self._points: list[int] = []
        self._owners: list[str] = []

    def choose(self, candidates: Sequence[C], key: str | None = None) -> C:
        _check(candidates)
        if key is None:
            return self._fallback.choose(candidates)
        by_name = {candidate.name: candidate for candidate in candidates}
        if frozenset(by_name) != self._ring_of:
            self._build(frozenset(by_name))
        index = bisect.bisect(self._points, _hash(key)) % len(self._points)
        return by_name[self._owners[index]]

    def _build(self, names: frozenset[str]) -> None:
        ring = sorted((_hash(f"{name}#{i}"), name) for name in names for i in range(self._virtual_nodes))
        self._points = [point for point, _ in ring]
        self._owners = [name for _, name in ring]
        self._ring_of = names


POLICIES: dict[str, Callable[[], Policy]] = {"round_robin": RoundRobin, "least_load": LeastLoad,
                                             "cache_aware": CacheAware}


def make_policy(name: str) -> Policy:
    """A fresh policy by its flag name (``RouterConfig`` has validated it)."""
    return POLICIES[name]()


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


def _check(candidates: Sequence[Candidate]) -> None:
    if not candidates:
        raise ValueError("a policy needs at least one candidate")
