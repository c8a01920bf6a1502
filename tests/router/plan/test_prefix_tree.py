"""Prefix-aware routing, pure: the routing units of a chat body and their hash chain
(``router.plan.prefix_tree``), the per-worker tree (match, insert, LRU eviction to a bound), the
``prefix_aware`` policy (longest match, threshold, spread, load imbalance, forgetting a worker), its
flags, the registry dropping a removed or moved worker's tree, and the hit-rate metrics. No sockets."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import pytest

from router.fleet.breaker import CircuitBreaker
from cli.router import add_router_args, router_config
from router.config import RouterConfig
from router.metrics import Metrics
from router.plan.modes import Call, PDPlanner
from router.plan.policy import PrefixAware, PrefixSettings, RoundRobin, make_policy
from router.plan.prefix_tree import CHUNK_CHARS, IMAGE_CHARS, URL_SAMPLE, Prefix, PrefixTree, chat_units, image_key
from router.fleet.registry import Registry
from router.fleet.workers import Pool, Worker

pytestmark = pytest.mark.unit


@dataclass
class C:
    name: str
    outstanding: int = 0


def call(*messages: dict) -> Call:
    return Call({"messages": list(messages)}, False, None, 0.0)


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def turns(topic: str, n: int) -> list[Call]:
    """The requests of one conversation's first ``n`` turns (each repeats the history before it, which
    is long enough that every turn's match covers more than half of it)."""
    history: list[dict] = [{"role": "system", "content": f"You talk about {topic}. " * 20}]
    calls = []
    for i in range(n):
        history.append(user(f"{topic} question {i}"))
        calls.append(call(*history))
        history.append({"role": "assistant", "content": f"answer {i}"})
    return calls


# --- routing units and their chain --------------------------------------------------------------
def test_chat_units_cut_each_message_and_name_images_by_key():
    ref = {"type": "image_ref", "image_ref": {"key": "k" * 32, "width": 4, "height": 4}}
    url = "data:image/png;base64,AAAA"
    body = {"messages": [
        {"role": "system", "content": "s" * 70},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, ref,
                                     {"type": "text", "text": "what?"}, {"type": "bogus"}]},
        "not a message",
    ]}
    system = "\x1esystem\n" + "s" * 70
    assert chat_units(body) == [
        (system[:CHUNK_CHARS], CHUNK_CHARS), (system[CHUNK_CHARS:], len(system) - CHUNK_CHARS),
        ("\x1euser\n", 6), ("\x1d" + image_key({"type": "image_url", "image_url": url}), IMAGE_CHARS),
        ("\x1d" + "k" * 32, IMAGE_CHARS), ("what?", 5)]
    assert chat_units({"messages": "no"}) == [] and chat_units({}) == []
    assert image_key({"type": "text", "text": "x"}) is None



def test_a_long_image_url_is_keyed_by_its_length_and_ends():
    def key(url: str) -> str | None:
        return image_key({"type": "image_url", "image_url": {"url": url}})

    head, tail = "h" * URL_SAMPLE, "t" * URL_SAMPLE
    assert key(head + "a" * 10 + tail) == key(head + "b" * 10 + tail)  # the middle of a long one is not read
    assert key(head + "a" * 10 + tail) != key(head + "a" * 11 + tail)
    assert key(head + "a" * 10 + tail[1:] + "x") != key(head + "a" * 10 + tail)
    assert key("h" * 10 + "a" + "t" * 10) != key("h" * 10 + "b" + "t" * 10)  # a short one is read whole


def test_a_later_turn_starts_with_the_earlier_turns_chain():
    first, second = turns("cats", 2)
    a, b = first.prefix, second.prefix
    assert b.nodes[:len(a.nodes)] == a.nodes and len(b.nodes) > len(a.nodes)
    assert b.weights[len(a.nodes) - 1] == a.total
    # the same unit at another position is another node: the chain names the whole prefix
    twice = Prefix.of([("x", 1), ("x", 1)])
    assert twice.nodes[0] != twice.nodes[1] and twice.weights == (1, 2)
    assert twice.weight(0) == 0 and twice.weight(2) == 2 == twice.total and Prefix.of([]).total == 0


def test_call_computes_its_prefix_only_when_a_policy_reads_it():
    pool = Pool("colocated", [Worker("http://c:1", "colocated", CircuitBreaker(1, 10.0), healthy=True, known=True)],
                RoundRobin())
    lazy = call(user("hello"))
    pool.pick(pool.candidates(), context=lazy)
    assert "prefix" not in vars(lazy)
    pool.policy = PrefixAware()
    pool.pick(pool.candidates(), context=lazy)
    assert vars(lazy)["prefix"].total == len("\x1euser\nhello")


# --- the tree -----------------------------------------------------------------------------------
def test_tree_matches_leading_units_and_changes_nothing_on_match():
    tree = PrefixTree(100)
    a = Prefix.of([("a", 1), ("b", 1), ("c", 1)])
    assert tree.match(a) == 0 and len(tree) == 0
    tree.insert(a)
    assert tree.match(a) == 3 and len(tree) == 3
    assert tree.match(Prefix.of([("a", 1), ("b", 1), ("x", 1), ("c", 1)])) == 2
    assert tree.match(Prefix.of([("b", 1)])) == 0  # b alone is another prefix
    tree.insert(a)
    assert len(tree) == 3


def test_eviction_bounds_the_tree_and_takes_leaves_first():
    tree = PrefixTree(6)
    shared = [("system", 1), ("prompt", 1)]
    conversations = [Prefix.of([*shared, (f"q{i}", 1), (f"r{i}", 1)]) for i in range(4)]
    for prefix in conversations:
        tree.insert(prefix)
        assert len(tree) <= 6
    assert len(tree) == 6
    # the oldest conversations lost their leaves; the shared prefix, refreshed by each, is kept
    assert [tree.match(p) for p in conversations] == [2, 2, 4, 4]
    many = PrefixTree(5)
    many.insert(Prefix.of([(str(i), 1) for i in range(12)]))  # longer than the bound: its start is kept
    assert len(many) == 5 and many.match(Prefix.of([(str(i), 1) for i in range(12)])) == 5
    with pytest.raises(ValueError, match="max_nodes > 0, got 0"):
        PrefixTree(0)


# --- the policy ---------------------------------------------------------------------------------
class Seen:
    def __init__(self) -> None:
        self.picks: list[tuple[str, int, int]] = []

    def __call__(self, by: str, matched: int, total: int) -> None:
        self.picks.append((by, matched, total))


def test_conversations_spread_then_each_sticks_to_its_worker():
    seen = Seen()
    policy, workers = PrefixAware(observe=seen), [C("w1"), C("w2")]
    cats, dogs = turns("cats", 3), turns("dogs", 3)
    first = [policy.choose(workers, context=cats[0]).name, policy.choose(workers, context=dogs[0]).name]
    assert first == ["w1", "w2"]  # the second conversation goes to the smaller tree
    for i in (1, 2):
        assert policy.choose(workers, context=cats[i]).name == "w1"
        assert policy.choose(list(reversed(workers)), context=dogs[i]).name == "w2"  # order does not matter
    assert [by for by, _, _ in seen.picks] == ["spread", "spread", "match", "match", "match", "match"]
    by, matched, total = seen.picks[2]
    assert (matched, total) == (cats[0].prefix.total, cats[1].prefix.total)


def test_longest_match_wins_and_below_the_threshold_the_smallest_tree():
    seen = Seen()
    policy, workers = PrefixAware(PrefixSettings(cache_threshold=0.5), seen), [C("w1"), C("w2")]
    long = call(user("x" * 640))  # "\x1euser\n" and 640 x: 646 characters, 11 units
    assert policy.choose(workers, context=long).name == "w1"
    short = call(user("x" * 128))  # its first 2 units (128 of 134 characters) are long's
    assert policy.choose(workers, context=short).name == "w1"
    assert policy.tree_sizes() == {"w1": 12, "w2": 0}
    answered = call(user("x" * 640), {"role": "assistant", "content": "y" * 1000})  # 646 of 1657 matched
    assert policy.choose(workers, context=answered).name == "w2"
    followup = call(user("x" * 640), {"role": "assistant", "content": "y" * 1000}, user("more"))
    assert policy.choose(workers, context=followup).name == "w2"  # w2 holds 11 + 17 units, w1 11
    # the chosen worker's match is what counts: w2 held nothing of the third
    assert seen.picks == [("spread", 0, 646), ("match", 128, 134), ("spread", 0, 1657), ("match", 1657, 1667)]


def test_imbalance_needs_both_thresholds_and_then_overrides_the_match():
    policy = PrefixAware(PrefixSettings(balance_abs=8, balance_rel=1.5))
    workers = [C("w1"), C("w2")]
    conversation = turns("cats", 2)
    assert policy.choose(workers, context=conversation[0]).name == "w1"
    workers[0].outstanding, workers[1].outstanding = 30, 21  # 9 more but not 1.5x: balanced
    assert policy.choose(workers, context=conversation[1]).name == "w1"
    workers[0].outstanding, workers[1].outstanding = 8, 0  # 1.5x but not more than 8 apart: balanced
    assert policy.choose(workers, context=conversation[1]).name == "w1"
    workers[0].outstanding = 9  # both: the least loaded, whatever it holds
    assert policy.choose(workers, context=conversation[1]).name == "w2"
    assert policy.imbalanced([32, 21]) and not policy.imbalanced([31, 21]) and not policy.imbalanced([5])


def test_a_forgotten_worker_starts_from_nothing():
    seen = Seen()
    policy, workers = PrefixAware(observe=seen), [C("w1"), C("w2")]
    cats = turns("cats", 3)
    policy.choose(workers, context=cats[0])
    policy.choose(workers, context=turns("dogs", 1)[0])
    assert policy.choose(workers, context=cats[1]).name == "w1"
    policy.forget("w1")
    assert policy.tree_sizes().keys() == {"w2"}
    assert policy.choose(workers, context=cats[2]).name == "w1"  # an empty tree is the smallest again
    assert seen.picks[-1] == ("spread", 0, cats[2].prefix.total)
    policy.forget("gone")  # unknown: nothing to do


def test_without_a_request_it_balances_load_and_keeps_no_tree():
    policy = PrefixAware()
    assert policy.choose([C("w1", 3), C("w2", 1)]).name == "w2"
    assert policy.tree_sizes() == {}
    with pytest.raises(ValueError, match="at least one candidate"):
        policy.choose([], context=call(user("x")))


# --- flags, registry, metrics -------------------------------------------------------------------
def parse(*argv: str) -> RouterConfig:
    parser = argparse.ArgumentParser()
    add_router_args(parser)
    return router_config(parser.parse_args(list(argv)))


def test_flags_and_their_validation():
    config = parse("--colocated", "http://h:1", "--policy-colocated", "prefix_aware", "--prefix-cache-threshold",
                   "0.25", "--prefix-balance-abs", "4", "--prefix-balance-rel", "2", "--prefix-tree-nodes", "10")
    assert config.policy("colocated") == "prefix_aware"
    assert config.prefix_settings == PrefixSettings(0.25, 4, 2.0, 10)
    assert parse("--prefill", "http://p:1", "--decode", "http://d:1", "--policy-prefill",
                 "prefix_aware").policy("prefill") == "prefix_aware"
    assert RouterConfig(colocated=("http://h:1",)).prefix_settings == PrefixSettings()
    for role in ("decode", "encoder"):
        with pytest.raises(ValueError, match=f"--policy-{role} must be one of"):
            RouterConfig(prefill=("http://p:1",), decode=("http://d:1",), **{f"policy_{role}": "prefix_aware"})
    for field, value, message in [
            ("prefix_cache_threshold", 1.5, "--prefix-cache-threshold must be in [0, 1], got 1.5"),
            ("prefix_balance_abs", -1, "--prefix-balance-abs must be >= 0, got -1"),
            ("prefix_balance_rel", 0.5, "--prefix-balance-rel must be >= 1, got 0.5"),
            ("prefix_tree_nodes", 0, "--prefix-tree-nodes must be > 0, got 0")]:
        with pytest.raises(ValueError) as refused:
            RouterConfig(colocated=("http://h:1",), **{field: value})
        assert str(refused.value) == message
    assert isinstance(make_policy("prefix_aware"), PrefixAware)


def sample(metrics: Metrics, name: str) -> float:
    value = metrics.registry.get_sample_value(name)
    assert value is not None, name
    return value


def test_the_registry_forgets_a_removed_or_moved_workers_tree_and_metrics_count_hits():
    config = RouterConfig(prefill=("http://p:1", "http://p:2"), decode=("http://d:1",), policy_prefill="prefix_aware",
                          prefix_tree_nodes=50)
    metrics = Metrics()
    registry = Registry.for_config(config, metrics)
    pool = registry.pools["prefill"]
    assert isinstance(pool.policy, PrefixAware) and pool.policy.settings.tree_nodes == 50
    for w in registry:
        w.known, w.healthy = True, True
    cats = turns("cats", 2)
    p1 = pool.pick(pool.candidates(), context=cats[0])
    p2 = pool.pick(pool.candidates(), context=turns("dogs", 1)[0])
    assert pool.pick(pool.candidates(), context=cats[1]) is p1
    assert {by: metrics.registry.get_sample_value("epd_router_prefix_routes_total", {"by": by})
            for by in ("match", "spread", "load")} == {"match": 1.0, "spread": 2.0, "load": 0.0}
    assert sample(metrics, "epd_router_prefix_match_chars_total") == cats[0].prefix.total
    assert sample(metrics, "epd_router_prefix_request_chars_total") == (
        cats[0].prefix.total + turns("dogs", 1)[0].prefix.total + cats[1].prefix.total)
    registry.remove(p1)
    assert pool.policy.tree_sizes().keys() == {p2.url}
    registry.begin_switch(p2)
    registry.move(p2, "decode")
    assert pool.policy.tree_sizes() == {}


async def test_pd_plans_pick_their_prefill_by_prefix():
    config = RouterConfig(prefill=("http://p:1", "http://p:2"), decode=("http://d:1",), policy_prefill="prefix_aware")
    registry = Registry.for_config(config, Metrics())
    for w in registry:
        w.known, w.healthy, w.fingerprint = True, True, {"model": "m"}
        w.bootstrap = ("127.0.0.1", 9000) if w.role == "prefill" else None
    planner = PDPlanner(registry.pools["prefill"], registry.pools["decode"])
    cats, dogs = turns("cats", 3), turns("dogs", 3)
    order = [cats[0], dogs[0], cats[1], cats[2], dogs[1], dogs[2]]
    assert [(await planner.plan(c, ())).sides[0].worker.url for c in order] == \
        ["http://p:1", "http://p:2", "http://p:1", "http://p:1", "http://p:2", "http://p:2"]
