"""The router's policies (router/plan/policy.py): pure choice functions over plain candidates."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import pytest

from router.plan.policy import CacheAware, LeastLoad, RoundRobin, make_policy

pytestmark = pytest.mark.unit


@dataclass
class C:
    name: str
    outstanding: int = 0


def names(chosen) -> list[str]:
    return [c.name for c in chosen]


def test_round_robin_takes_each_in_turn():
    policy, cs = RoundRobin(), [C("a"), C("b"), C("c")]
    assert names(policy.choose(cs) for _ in range(7)) == ["a", "b", "c", "a", "b", "c", "a"]


def test_round_robin_over_a_changing_set_never_picks_outside_it():
    policy = RoundRobin()
    assert names(policy.choose([C("a"), C("b")]) for _ in range(2)) == ["a", "b"]
    assert policy.choose([C("c")]).name == "c"


def test_least_load_picks_the_fewest_outstanding():
    policy = LeastLoad()
    cs = [C("a", 3), C("b", 1), C("c", 2)]
    assert names(policy.choose(cs) for _ in range(4)) == ["b"] * 4


def test_least_load_alternates_between_equals():
    policy = LeastLoad()
    cs = [C("a", 1), C("b", 0), C("c", 0)]
    assert names(policy.choose(cs) for _ in range(4)) == ["b", "b", "c", "b"]
    even = [C("a"), C("b"), C("c")]
    assert Counter(names(policy.choose(even) for _ in range(30))) == {"a": 10, "b": 10, "c": 10}


def test_least_load_follows_load_as_it_changes():
    policy, cs = LeastLoad(), [C("a"), C("b")]
    for _ in range(6):  # each pick adds load to the chosen one, as the dispatcher's lease does
        policy.choose(cs).outstanding += 1
    assert [c.outstanding for c in cs] == [3, 3]


def test_cache_aware_sends_a_key_to_the_same_candidate():
    policy = CacheAware()
    cs = [C("e0"), C("e1"), C("e2")]
    first = {f"key{i}": policy.choose(cs, f"key{i}").name for i in range(300)}
    again = {f"key{i}": policy.choose(list(reversed(cs)), f"key{i}").name for i in range(300)}
    assert first == again  # the candidates' order does not matter
    assert min(Counter(first.values()).values()) > 50  # and the keys spread over all of them


def test_cache_aware_moves_only_the_departed_candidates_keys():
    policy = CacheAware()
    three = [C("e0"), C("e1"), C("e2")]
    before = {f"k{i}": policy.choose(three, f"k{i}").name for i in range(600)}
    after = {k: policy.choose(three[:2], k).name for k in before}
    moved = [k for k in before if before[k] != after[k]]
    assert moved and all(before[k] == "e2" for k in moved)
    assert set(after.values()) == {"e0", "e1"}
    assert {k: policy.choose(three, k).name for k in before} == before  # e2 back: its keys come back


def test_cache_aware_without_a_key_balances_load():
    policy = CacheAware()
    assert policy.choose([C("e0", 2), C("e1", 0)]).name == "e1"


def test_policies_by_name_and_empty_candidates():
    assert isinstance(make_policy("round_robin"), RoundRobin)
    assert isinstance(make_policy("least_load"), LeastLoad)
    assert isinstance(make_policy("cache_aware"), CacheAware)
    for policy in (RoundRobin(), LeastLoad(), CacheAware()):
        with pytest.raises(ValueError, match="at least one candidate"):
            policy.choose([], "k")
