"""Which worker of a role gets the next request. Pure: no I/O, no clock.

A policy chooses among candidates the caller has already filtered (healthy, circuit allows,
compatible, not excluded). ``choose`` is called once per pick, on the event loop; it may update
the policy's own state (its cursor, prefix_aware's trees) but never the candidates.

    round_robin   each candidate in turn
    least_load    fewest outstanding requests; ties go round robin (so equal loads alternate)
    cache_aware   encoders: consistent hashing on the image key, so the same image goes to the same
                  encoder while the set of candidates stays the same, and only 1/N of the keys move
                  when a candidate leaves or joins; without a key, least_load
    prefix_aware  prefills and colocated workers: an approximate prefix tree per candidate of what it was
                  sent (``router.plan.prefix_tree``), balanced against load as SGLang's gateway does with
                  its cache_aware. Loads imbalanced (max - min > ``balance_abs`` and max > ``balance_rel`` *
                  min): the least loaded. Else the longest match if it covers at least
                  ``cache_threshold`` of the request, else the smallest tree (new conversations spread
                  over the workers' cache space). The chosen candidate's tree then holds the request.

A policy that keeps something per candidate drops it in ``forget`` (the registry calls it when a
worker is removed or leaves the role).
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from router.plan.prefix_tree import Prefix, PrefixTree

VIRTUAL_NODES = 64  # points per candidate on the hash ring; more points, more even spread


class Candidate(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def outstanding(self) -> int: ...


C = TypeVar("C", bound=Candidate)  # a policy hands back one of the candidates it was given, as given


class RouteContext(Protocol):
    """What a policy may read of the request it picks for (``router.plan.modes.Call``)."""

    @property
    def prefix(self) -> Prefix:
        """The request's routing units as a hash chain; computed when first read."""
        ...


class Policy(Protocol):
    def choose(self, candidates: Sequence[C], key: str | None = None, context: RouteContext | None = None) -> C:
        """One of ``candidates`` (non-empty). ``key``: the image key, for cache_aware; ``context``: the
        request, for prefix_aware (the others never read it)."""
        ...

    def forget(self, name: str) -> None:
        """The candidate ``name`` left the pool (removed, or moved to another role): drop what is kept of it."""
        ...


class RoundRobin:
    def __init__(self) -> None:
        self._turn = 0

    def choose(self, candidates: Sequence[C], key: str | None = None, context: RouteContext | None = None) -> C:
        _check(candidates)
        chosen = candidates[self._turn % len(candidates)]
        self._turn += 1
        return chosen

    def forget(self, name: str) -> None:
        pass


class LeastLoad:
    def __init__(self) -> None:
        self._turn = 0

    def choose(self, candidates: Sequence[C], key: str | None = None, context: RouteContext | None = None) -> C:
        _check(candidates)
        return min(self.rotated(candidates), key=lambda c: c.outstanding)  # min keeps the first of equals

    def rotated(self, candidates: Sequence[C]) -> list[C]:
        """``candidates`` from the next one in turn: ties among them alternate."""
        start = self._turn % len(candidates)
        self._turn += 1
        return [*candidates[start:], *candidates[:start]]

    def forget(self, name: str) -> None:
        pass


class CacheAware:
    def __init__(self, virtual_nodes: int = VIRTUAL_NODES) -> None:
        self._virtual_nodes = virtual_nodes
        self._fallback = LeastLoad()
        self._ring_of: frozenset[str] = frozenset()
        self._points: list[int] = []
        self._owners: list[str] = []

    def choose(self, candidates: Sequence[C], key: str | None = None, context: RouteContext | None = None) -> C:
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

    def forget(self, name: str) -> None:
        pass  # the ring follows the candidates it is given


@dataclass(frozen=True)
class PrefixSettings:
    """prefix_aware's thresholds (``RouterConfig`` validates them, naming their flags)."""

    cache_threshold: float = 0.5  # the longest match wins if it covers this much of the request
    balance_abs: int = 8  # loads are imbalanced if max - min exceeds this ...
    balance_rel: float = 1.5  # ... and max exceeds this times min
    tree_nodes: int = 1 << 16  # per candidate (a node: up to 64 characters of text, or one image)


Observe = Callable[[str, int, int], None]  # (by: match, spread or load; weight matched; weight of the request)


class PrefixAware:
    def __init__(self, settings: PrefixSettings = PrefixSettings(), observe: Observe | None = None) -> None:
        self.settings = settings
        self._observe = observe
        self._trees: dict[str, PrefixTree] = {}
        self._fallback = LeastLoad()

    def choose(self, candidates: Sequence[C], key: str | None = None, context: RouteContext | None = None) -> C:
        _check(candidates)
        if context is None:
            return self._fallback.choose(candidates)
        prefix = context.prefix
        matched = {c.name: self._tree(c.name).match(prefix) for c in candidates}
        rotated = self._fallback.rotated(candidates)  # ties alternate
        if self.imbalanced([c.outstanding for c in candidates]):
            by, chosen = "load", min(rotated, key=lambda c: c.outstanding)
        else:
            by, chosen = "match", max(rotated, key=lambda c: (matched[c.name], -c.outstanding))
            if prefix.weight(matched[chosen.name]) < self.settings.cache_threshold * prefix.total or not prefix.total:
                by, chosen = "spread", min(rotated, key=lambda c: (len(self._tree(c.name)), c.outstanding))
        self._tree(chosen.name).insert(prefix)
        if self._observe is not None:
            self._observe(by, prefix.weight(matched[chosen.name]), prefix.total)
        return chosen

    def imbalanced(self, loads: Sequence[int]) -> bool:
        low, high = min(loads), max(loads)
        return high - low > self.settings.balance_abs and high > self.settings.balance_rel * low

    def forget(self, name: str) -> None:
        self._trees.pop(name, None)

    def tree_sizes(self) -> dict[str, int]:
        """Nodes held per candidate name."""
        return {name: len(tree) for name, tree in self._trees.items()}

    def _tree(self, name: str) -> PrefixTree:
        tree = self._trees.get(name)
        if tree is None:
            tree = self._trees[name] = PrefixTree(self.settings.tree_nodes)
        return tree


POLICIES: dict[str, Callable[[], Policy]] = {"round_robin": RoundRobin, "least_load": LeastLoad,
                                             "cache_aware": CacheAware, "prefix_aware": PrefixAware}


def make_policy(name: str, prefix: PrefixSettings | None = None, observe: Observe | None = None) -> Policy:
    """A fresh policy by its flag name (``RouterConfig`` has validated it); ``prefix`` and ``observe``
    are prefix_aware's settings and the hook it reports each pick to (the router's metrics)."""
    if name == "prefix_aware":
        return PrefixAware(prefix or PrefixSettings(), observe)
    return POLICIES[name]()


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


def _check(candidates: Sequence[Candidate]) -> None:
    if not candidates:
        raise ValueError("a policy needs at least one candidate")
