"""router/fleet/dns_watch.py round by round, with the real registry, metrics and drain (Membership.drain),
and two stand-ins: the DNS answers (``resolve`` scripted per round) and the admission's HTTP checks
(``Membership.add`` admits at once, or refuses the URLs told to). The DNS server itself and real
workers are tests/router/fleet/test_dns_discovery.py's."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

import router.fleet.dns_watch as dns_watch
from router.config import RouterConfig
from router.fleet.dns_resolve import DnsFailure
from router.errors import RouterError
from router.fleet.membership import Membership
from router.metrics import Metrics
from router.fleet.registry import Registry

pytestmark = pytest.mark.unit

SOURCE = "dns://w.test:8000"
A, B, C = "http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.3:8000"
STATIC = "http://10.0.0.9:8000"


class Admitting(Membership):
    """Membership whose ``add`` skips the HTTP checks: it admits, or refuses a URL in ``refuse``."""

    refuse: dict[str, str]

    async def add(self, url: str, role: str, group: str | None, source: str = "admin") -> dict:
        if url in self.refuse:
            raise RouterError(409, self.refuse[url], code="worker_unhealthy")
        worker = self.registry.new_worker(url, role, group)
        worker.known = worker.healthy = True
        self.registry.add(worker, source)
        return {}


def scripted_watch(monkeypatch, config: RouterConfig,
                   answers: list[frozenset[str] | DnsFailure]) -> dns_watch.DnsWatch:
    """A DnsWatch on the real registry, metrics and drain whose resolutions are ``answers``, in order
    (a DnsFailure is raised); admission skips HTTP (``Admitting``)."""
    metrics = Metrics()
    registry = Registry.for_config(config, metrics)
    membership = Admitting(config, registry, None, None, None)  # type: ignore[arg-type]
    membership.refuse = {}

    async def resolve(resolver, source):
        answer = answers.pop(0)
        if isinstance(answer, DnsFailure):
            raise answer
        return answer

    monkeypatch.setattr(dns_watch, "resolve", resolve)
    return dns_watch.DnsWatch(config, registry, membership, metrics)


@pytest.fixture
def watch(monkeypatch):
    config = RouterConfig(colocated=(STATIC,), discover=("colocated=dns://w.test:8000",), drain_timeout_s=5.0)
    answers: list[frozenset[str] | DnsFailure] = []
    watcher = scripted_watch(monkeypatch, config, answers)
    watcher.answers = answers  # type: ignore[attr-defined]
    return watcher


def state(watch) -> dict[str, tuple[str, bool]]:
    """url -> (source, draining) of every worker."""
    return {w.url: (watch.registry.source(w), w.draining) for w in watch.registry}


async def follow(watch, *answers) -> None:
    for answer in answers:
        watch.answers.append(answer if isinstance(answer, DnsFailure) else frozenset(answer))
        await watch.round()


async def until(what: str, ok) -> None:
    deadline = time.monotonic() + 5
    while not ok():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.01)


def test_added_drained_resumed_removed(watch):
    async def run():
        await follow(watch, {A, B})
        assert state(watch) == {STATIC: ("static", False), A: (SOURCE, False), B: (SOURCE, False)}
        a = watch.registry.by_url(A)
        a.outstanding = 1  # a request in flight on A
        await follow(watch, {B})
        assert state(watch)[A] == (SOURCE, True)  # drained, kept while busy
        await follow(watch, {A, B})
        assert state(watch)[A] == (SOURCE, False)  # named again before it was idle: resumed
        await follow(watch, {B, C})
        assert state(watch)[A] == (SOURCE, True) and state(watch)[C] == (SOURCE, False)
        a.outstanding = 0  # its request finished
        await until("A removed once idle", lambda: watch.registry.by_url(A) is None)
        assert state(watch) == {STATIC: ("static", False), B: (SOURCE, False), C: (SOURCE, False)}

    asyncio.run(run())


def watch_log(caplog) -> list[str]:
    """The messages the watch logged; another library's record (asyncio reporting a task some other
    test left behind, say) is not the watch's to answer for."""
    return [r.getMessage() for r in caplog.records if r.name == "router.fleet.dns_watch"]


def test_failures_and_empty_answers_change_nothing(watch, caplog):
    async def run():
        await follow(watch, {A, B})
        before = state(watch)
        await follow(watch, DnsFailure("timeout", "A w.test: no answer in time"),
                     DnsFailure("timeout", "A w.test: no answer in time"),
                     DnsFailure("nxdomain", "w.test does not exist (NXDOMAIN)"), set(),
                     DnsFailure("servfail", "A w.test: REFUSED"))
        assert state(watch) == before

    with caplog.at_level(logging.INFO, logger="router.fleet.dns_watch"):
        asyncio.run(run())
    assert watch_log(caplog) == [
        f"{SOURCE} answers: 2 address(es)",
        f"{SOURCE}: A w.test: no answer in time; it keeps its 2 worker(s)",  # once for two timeouts in a row
        f"{SOURCE}: w.test does not exist (NXDOMAIN); it keeps its 2 worker(s)",
        f"{SOURCE}: the answer has no address; it keeps its 2 worker(s)",
        f"{SOURCE}: A w.test: REFUSED; it keeps its 2 worker(s)"]
    rendered = watch.registry.metrics.render().decode()
    for kind, count in (("timeout", 2), ("nxdomain", 1), ("servfail", 1), ("error", 0)):
        assert f'epd_router_dns_failures_total{{kind="{kind}",source="{SOURCE}"}} {count:.1f}' in rendered
    assert f'epd_router_dns_addresses{{source="{SOURCE}"}} 2.0' in rendered


def test_a_refused_address_is_logged_once_and_admitted_when_ready(watch, caplog):
    watch.membership.refuse[B] = f"{B}/health answered HTTP 503; add it once it is healthy"

    async def run():
        await follow(watch, {A, B}, {A, B}, {A, B})
        assert B not in state(watch)
        del watch.membership.refuse[B]
        await follow(watch, {A, B})
        assert state(watch)[B] == (SOURCE, False)

    with caplog.at_level(logging.WARNING, logger="router.fleet.dns_watch"):
        asyncio.run(run())
    assert watch_log(caplog) == [
        f"{SOURCE}: colocated {B} not admitted (tried again every round): {B}/health answered HTTP 503; add it "
        "once it is healthy"]


def test_a_static_worker_is_not_the_sources(watch):
    async def run():
        await follow(watch, {STATIC, A})
        assert state(watch) == {STATIC: ("static", False), A: (SOURCE, False)}
        await follow(watch, {A})  # STATIC left the answer: not the source's to drain
        assert state(watch) == {STATIC: ("static", False), A: (SOURCE, False)}

    asyncio.run(run())


def test_first_round_waits_for_a_worker_within_the_deadline(monkeypatch):
    config = RouterConfig(discover=("colocated=dns://w.test:8000",), discover_interval_s=0.01)
    answers = [DnsFailure("nxdomain", "w.test does not exist (NXDOMAIN)")] * 3 + [frozenset({A})]
    watcher = scripted_watch(monkeypatch, config, answers)
    registry = watcher.registry
    asyncio.run(watcher.first_round(time.monotonic() + 5))
    assert [w.url for w in registry] == [A] and answers == []
    answers[:] = [DnsFailure("timeout", "t")] * 1000
    started = time.monotonic()
    registry.remove(registry.by_url(A))
    asyncio.run(watcher.first_round(time.monotonic() + 0.3))  # gives up at the deadline
    assert 0.3 <= time.monotonic() - started < 2 and len(registry) == 0
