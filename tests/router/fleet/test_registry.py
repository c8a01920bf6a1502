"""The router's worker registry (``router.fleet.registry``), pure: add, find, remove, drain, resume, a role
switch moving a worker between the per-role views, and the views staying consistent with the one
list through all of it. No sockets."""

from __future__ import annotations

import pytest

from router.fleet.breaker import CircuitBreaker
from router.config import RouterConfig
from router.errors import RouterError
from router.fleet.load import Sample
from router.metrics import Metrics
from router.plan.policy import RoundRobin
from router.fleet.registry import Registry
from router.runtime import Router
from router.fleet.workers import Pool, Worker

pytestmark = pytest.mark.unit

FP = {"model": "m", "backend": "mooncake", "block_size": 16}


def registry_of(*workers: tuple[str, str], mode: str = "pd") -> Registry:
    roles = {"pd": ("prefill", "decode"), "epd": ("encoder", "prefill", "decode"), "colocated": ("colocated",)}[mode]
    registry = Registry(mode, {role: RoundRobin() for role in roles}, Metrics(), lambda: CircuitBreaker(1, 10.0))
    for url, role in workers:
        worker = registry.add(registry.new_worker(url, role))
        worker.known, worker.healthy, worker.models, worker.fingerprint = True, True, ("m",), FP
    return registry


def views(registry: Registry) -> dict[str, list[str]]:
    return {role: [w.id for w in pool.workers] for role, pool in registry.pools.items()}


def exported(registry: Registry) -> set[tuple[str, str]]:
    """(role, url) of every worker the metrics export."""
    return {(s.labels["role"], s.labels["worker"]) for family in registry.metrics.registry.collect()
            if family.name == "epd_router_worker_healthy" for s in family.samples}


def assert_consistent(registry: Registry) -> None:
    """Each worker in exactly the view of its role, the views' union the registry, the metrics the same."""
    listed = [w.id for w in registry]
    in_views = [w.id for pool in registry.pools.values() for w in pool.workers]
    assert sorted(listed) == sorted(in_views) and len(set(in_views)) == len(in_views)
    for role, pool in registry.pools.items():
        assert all(w.role == role for w in pool.workers)
    assert exported(registry) == {(w.role, w.url) for w in registry}


def test_added_workers_are_named_in_order_and_seen_by_their_role_only():
    registry = registry_of(("http://p:1", "prefill"), ("http://d:1", "decode"), ("http://p:2", "prefill"))
    assert [(w.id, w.url) for w in registry] == [("w1", "http://p:1"), ("w2", "http://d:1"), ("w3", "http://p:2")]
    assert views(registry) == {"prefill": ["w1", "w3"], "decode": ["w2"]}
    assert len(registry) == 3 and registry.find("w2").url == "http://d:1"
    assert registry.by_url("http://p:2") is registry.find("w3") and registry.by_url("http://p:9") is None
    assert_consistent(registry)


@pytest.mark.parametrize("url, role, status, code, message", [
    ("http://p:1", "decode", 409, "worker_exists", "http://p:1 is already worker w1 (prefill)"),
    ("http://e:1", "encoder", 400, "invalid_role", "this router runs pd mode: it takes prefill, decode workers, "
     "not 'encoder'"),
])
def test_a_refused_add_changes_nothing(url, role, status, code, message):
    registry = registry_of(("http://p:1", "prefill"), ("http://d:1", "decode"))
    with pytest.raises(RouterError) as error:
        registry.add(registry.new_worker(url, role))
    assert (error.value.status, error.value.code, error.value.message) == (status, code, message)
    assert views(registry) == {"prefill": ["w1"], "decode": ["w2"]}
    registry.add(registry.new_worker("http://d:2", "decode"))
    assert views(registry) == {"prefill": ["w1"], "decode": ["w2", "w3"]}  # no id was spent on the refusal
    assert_consistent(registry)


def test_find_names_a_missing_worker():
    with pytest.raises(RouterError) as error:
        registry_of(("http://c:1", "colocated"), mode="colocated").find("w9")
    assert (error.value.status, error.value.code, error.value.message) == (
        404, "worker_not_found", "no worker 'w9'; GET /admin/workers lists them")


def test_remove_refuses_a_busy_worker_unless_forced_and_then_every_view_forgets_it():
    registry = registry_of(("http://p:1", "prefill"), ("http://d:1", "decode"), ("http://d:2", "decode"))
    forgotten: list[str] = []
    registry.on_remove.append(lambda w: forgotten.append(w.id))
    busy = registry.find("w2")
    busy.outstanding = 2
    with pytest.raises(RouterError) as error:
        registry.remove(busy)
    assert (error.value.status, error.value.code, error.value.message) == (
        409, "worker_busy", "w2 (decode http://d:1) has 2 request(s) in flight: drain it first "
        "(POST /admin/workers/w2/drain) or remove it with ?force=true")
    assert views(registry) == {"prefill": ["w1"], "decode": ["w2", "w3"]} and forgotten == []
    registry.remove(busy, force=True)
    assert views(registry) == {"prefill": ["w1"], "decode": ["w3"]} and forgotten == ["w2"]
    assert_consistent(registry)
    assert [w.url for w in registry.pools["decode"].candidates()] == ["http://d:2"]


def test_drain_takes_a_worker_out_of_the_candidates_and_resume_puts_it_back():
    registry = registry_of(("http://p:1", "prefill"), ("http://d:1", "decode"), ("http://d:2", "decode"))
    d1 = registry.find("w2")
    registry.drain(d1)
    assert [w.id for w in registry.pools["decode"].candidates()] == ["w3"]
    assert views(registry)["decode"] == ["w2", "w3"]  # still a member: its requests finish
    registry.resume(d1)
    assert [w.id for w in registry.pools["decode"].candidates()] == ["w2", "w3"]


def test_a_role_switch_moves_a_pd_worker_between_the_views():
    registry = registry_of(("http://p:1", "prefill"), ("http://x:1", "prefill"), ("http://d:1", "decode"))
    x = registry.find("w2")
    registry.begin_switch(x)
    assert x.draining and registry.switching(x)
    for act, what in ((lambda: registry.resume(x), "resume"), (lambda: registry.remove(x, force=True), "remove"),
                      (lambda: registry.begin_switch(x), "switch")):
        with pytest.raises(RouterError) as error:
            act()
        assert (error.value.status, error.value.code, error.value.message) == (
            409, "worker_busy", f"w2 is switching roles; {what} it once the split is applied")
    registry.move(x, "decode")
    assert views(registry) == {"prefill": ["w1"], "decode": ["w2", "w3"]}
    assert [w.id for w in registry] == ["w1", "w2", "w3"]  # the listing keeps admission order
    assert_consistent(registry)
    assert "w2" not in [w.id for w in registry.pools["decode"].candidates()]  # not before the switch ends
    registry.end_switch(x)
    assert not x.draining and not registry.switching(x)
    assert [w.id for w in registry.pools["decode"].candidates()] == ["w2", "w3"]
    registry.resume(x)
    registry.remove(x)
    assert views(registry) == {"prefill": ["w1"], "decode": ["w3"]}
    assert_consistent(registry)


def test_only_a_switching_worker_moves_and_only_to_a_role_of_the_mode():
    registry = registry_of(("http://p:1", "prefill"), ("http://d:1", "decode"))
    p = registry.find("w1")
    with pytest.raises(ValueError):
        registry.move(p, "decode")
    registry.begin_switch(p)
    with pytest.raises(ValueError):
        registry.move(p, "encoder")
    assert views(registry) == {"prefill": ["w1"], "decode": ["w2"]}
    assert_consistent(registry)


def test_iterating_is_a_snapshot():
    registry = registry_of(("http://p:1", "prefill"), ("http://d:1", "decode"))
    seen = []
    for worker in registry:
        seen.append(worker.id)
        if worker.id == "w1":
            registry.add(registry.new_worker("http://d:2", "decode"))
    assert seen == ["w1", "w2"] and [w.id for w in registry] == ["w1", "w2", "w3"]


async def test_the_router_builds_its_registry_from_the_flags_and_forgets_removed_workers():
    router = Router(RouterConfig(prefill=("http://p:1", "http://p:2"), decode=("http://d:1",)))
    try:
        registry = router.registry
        assert [(w.id, w.role, w.url) for w in registry] == [
            ("w1", "prefill", "http://p:1"), ("w2", "prefill", "http://p:2"), ("w3", "decode", "http://d:1")]
        assert router.answering is registry.pools["decode"]
        assert_consistent(registry)
        p1, d1 = registry.find("w1"), registry.find("w3")
        router.pairing.refused |= {(p1.url, d1.url), ("http://p:2", d1.url)}
        router.history.add("w1", Sample(at=1.0, role="prefill", busy_s=0.0, units=0.0, queue_depth=0.0, running=0.0,
                                        kv_blocks_used=None))
        assert router.history.latest("w1") is not None
        registry.remove(p1)
        assert router.pairing.refused == {("http://p:2", d1.url)} and router.history.latest("w1") is None
        assert_consistent(registry)
    finally:
        await router.close()


def test_a_pool_is_a_view_of_its_members_by_role():
    members = [Worker("http://p:1", "prefill", CircuitBreaker(1, 10.0)),
               Worker("http://d:1", "decode", CircuitBreaker(1, 10.0))]
    pool = Pool("prefill", members, RoundRobin())
    assert [w.url for w in pool.workers] == ["http://p:1"]
    members[1].role = "prefill"
    assert [w.url for w in pool.workers] == ["http://p:1", "http://d:1"]
