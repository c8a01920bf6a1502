"""DNS discovery: the router follows its ``--discover`` sources (``router.fleet.dns_source``), the way a
Kubernetes headless Service publishes its ready pods. (Not ``router.fleet.discovery``, which reads each
worker's info and checks its health; a worker found here is checked there like any other.)

Contract: ``first_round`` runs once at startup, after the static workers are discovered: it follows
every source until each role given only by ``--discover`` has a worker, or the startup deadline.
``run`` is then a supervised task of ``router.runtime`` for the router's whole life: every
``--discover-interval-s`` it resolves every source (``router.fleet.dns_resolve``, each query within
``--health-timeout-s``) and applies ``dns_source.plan``:
- a new address is admitted through ``Membership.add`` (the admin API's checks: ``/health``,
  ``/v1/models``, ``/server_info``, fingerprints), with the source's label as its source; one
  refused is logged once per reason and tried again next round;
- a worker the answer no longer names is drained at once (no new request), removed when idle or
  after ``--drain-timeout-s`` (its requests in flight still finish), unless an answer names it
  again first (then it is resumed);
- a failed answer (timeout, SERVFAIL, NXDOMAIN) or one with no address changes nothing: the source
  keeps its workers. It is counted in ``epd_router_dns_failures_total{source,kind}`` and logged once
  per change of the source's state (``ok``, ``empty`` or the failure's kind).
Only the workers that came from a source are ever drained or removed by it.
"""

from __future__ import annotations

import asyncio
import logging
import time

from prometheus_client import Counter, Gauge

from router.config import RouterConfig
from router.fleet.dns_resolve import KINDS, DnsFailure, make_resolver, resolve
from router.fleet.dns_source import DnsSource, parse_nameserver, plan
from router.errors import RouterError
from router.fleet.membership import Membership
from router.metrics import Metrics
from router.fleet.registry import Registry
from router.fleet.workers import Worker

log = logging.getLogger(__name__)
FIRST_ROUND_POLL_S = 0.5  # at startup, between rounds while a role has no worker yet


class DnsWatch:
    def __init__(self, config: RouterConfig, registry: Registry, membership: Membership, metrics: Metrics) -> None:
        self.config, self.registry, self.membership = config, registry, membership
        self.sources = config.dns_sources
        nameserver = parse_nameserver(config.discover_nameserver) if config.discover_nameserver else None
        self.resolver = make_resolver(nameserver, config.health_timeout_s)
        self._retiring: dict[str, asyncio.Task] = {}  # worker id -> its drain-then-remove task
        self._state: dict[str, str] = {}  # source label -> "ok", "empty" or a failure kind
        self._refused: dict[str, str] = {}  # URL -> why its last admission was refused (logged once)
        self.failures = Counter("epd_router_dns_failures", "--discover answers that failed, by source and kind "
                                "(timeout, nxdomain, servfail, error); the source kept its workers.",
                                ["source", "kind"], registry=metrics.registry)
        self.addresses = Gauge("epd_router_dns_addresses", "Worker addresses in the source's last answer that had any.",
                               ["source"], registry=metrics.registry)
        for source in self.sources:
            self.addresses.labels(source=source.label)
            for kind in KINDS:
                self.failures.labels(source=source.label, kind=kind)

    async def first_round(self, deadline: float) -> None:
        """Follow every source until each role given only by ``--discover`` has a worker, or ``deadline``
        (``time.monotonic``) has passed; those still lacking are logged (the caller refuses to start)."""
        while True:
            await self.round()
            lacking = [s.label for s in self.sources
                       if not getattr(self.config, s.role) and not self.registry.pools[s.role].workers]
            if not lacking:
                return
            if time.monotonic() >= deadline:
                log.warning("no worker found by %s at startup", ", ".join(lacking))
                return
            await asyncio.sleep(min(self.config.discover_interval_s, FIRST_ROUND_POLL_S))

    async def run(self) -> None:
        """Forever: sleep ``--discover-interval-s``, then follow every source. Cancelling it cancels the
        drains under way (the drained workers stay in the registry, drained)."""
        try:
            while True:
                await asyncio.sleep(self.config.discover_interval_s)
                await self.round()
        finally:
            tasks = list(self._retiring.values())
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def round(self) -> None:
        """Resolve every source once and apply what changed."""
        await asyncio.gather(*(self._follow(source) for source in self.sources))

    async def _follow(self, source: DnsSource) -> None:
        try:
            answer = await resolve(self.resolver, source)
        except DnsFailure as exc:
            self.failures.labels(source=source.label, kind=exc.kind).inc()
            self._note(source, exc.kind, f"{exc}; it keeps its {len(self.registry.of_source(source.label))} worker(s)")
            return
        mine = self.registry.of_source(source.label)  # read after the await: a drain may have removed one
        if not answer:
            self._note(source, "empty", f"the answer has no address; it keeps its {len(mine)} worker(s)")
            return
        self._note(source, "ok", f"{len(answer)} address(es)")
        self.addresses.labels(source=source.label).set(len(answer))
        drained = {w.url for w in mine if w.id in self._retiring}
        taken = {w.url for w in self.registry if self.registry.source(w) != source.label}
        changes = plan(answer, {w.url for w in mine} - drained, drained, taken)
        by_url = {w.url: w for w in mine}
        for url in changes.resume:
            self._resume(source, by_url[url])
        for url in changes.drain:
            self._retire(source, by_url[url])
        for url in set(self._refused) - answer:
            self._refused.pop(url)
        await asyncio.gather(*(self._admit(source, url) for url in changes.add))

    def _note(self, source: DnsSource, state: str, detail: str) -> None:
        """Log a source's state once per change of it."""
        previous = self._state.get(source.label)
        self._state[source.label] = state
        if state == previous:
            return
        if state == "ok":
            log.info("%s answers: %s", source.label, detail)
        else:
            log.warning("%s: %s", source.label, detail)

    async def _admit(self, source: DnsSource, url: str) -> None:
        try:
            await self.membership.add(url, source.role, None, source.label)
        except (RouterError, ValueError) as exc:
            if self._refused.get(url) != str(exc):
                log.warning("%s: %s %s not admitted (tried again every round): %s", source.label, source.role, url,
                            exc)
            self._refused[url] = str(exc)
            return
        self._refused.pop(url, None)

    def _retire(self, source: DnsSource, worker: Worker) -> None:
        """Drain ``worker`` now; remove it once idle (or after ``--drain-timeout-s``) in its own task."""
        self.registry.drain(worker)
        log.info("%s: %s %s (%s) left the answer; draining it (%d in flight)", source.label, worker.role, worker.url,
                 worker.id, worker.outstanding)
        task = asyncio.create_task(self._remove_when_idle(source, worker), name=f"dns drain {worker.id}")
        self._retiring[worker.id] = task
        task.add_done_callback(lambda done: self._retiring.pop(worker.id, None)
                               if self._retiring.get(worker.id) is done else None)

    async def _remove_when_idle(self, source: DnsSource, worker: Worker) -> None:
        idle = await self.membership.drain(worker, self.config.drain_timeout_s)
        try:
            self.registry.remove(worker, force=True)
        except RouterError as exc:  # it is switching roles: the next round drains it again
            log.warning("%s: %s not removed yet: %s", source.label, worker.id, exc)
            return
        log.info("%s: removed %s %s (%s)%s", source.label, worker.role, worker.url, worker.id,
                 "" if idle else f" after --drain-timeout-s with {worker.outstanding} request(s) still finishing")

    def _resume(self, source: DnsSource, worker: Worker) -> None:
        task = self._retiring.pop(worker.id)
        task.cancel()
        try:
            self.registry.resume(worker)
        except RouterError as exc:
            log.warning("%s: %s not resumed yet: %s", source.label, worker.id, exc)
            return
        log.info("%s: %s %s (%s) is in the answer again; resumed", source.label, worker.role, worker.url, worker.id)
