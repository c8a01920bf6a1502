"""Everything one router process owns: the registry of its workers (``router.fleet.registry``: per role a
pool with its policy), the upstream client, the image fetcher, the dispatcher, the metrics, and for
the admin API the membership (workers added and switched at runtime), the pairing rules, the room
log and the load history; and its supervised loops: health checks, load sampling,
(``--auto-ratio-interval-s``) the automatic ratio and (``--discover``) DNS discovery (``router.fleet.dns_watch``).

Lifecycle (driven by the app's startup and cleanup hooks, in the event loop): ``start`` opens the
clients, discovers the workers and refuses to start (``StartupError``) when the mode cannot serve:
no worker answered, or, in pd and epd mode, no prefill and decode share a fingerprint (each
incompatible pair is logged with the fields that differ), or, in epd mode, the encoders disagree
on their vision fingerprint (their image keys would differ); with an admin token it asks every
decode to allow every prefill (``Membership.connect``); it takes the chat request's schema from a
stage's ``/openapi.json`` (``learn_chat_schema``, also when the admin API adds a worker); then it
starts the loops. Workers found by ``--discover`` join after the static ones are discovered, before
the checks above (``DnsWatch.first_round``, within the same deadline). ``close`` stops the loops and
closes the clients (and, in epd mode, the embedding
cache's connections).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Coroutine

import aiohttp

from cache.config import MIB, CacheConfig
from cache.store import EmbeddingCache
from router.admin.ratio_loop import auto_ratio_loop
from router.config import RouterConfig
from router.fleet.discovery import InfoError, discover, health_loop, read_chat_schema
from router.fleet.dns_watch import DnsWatch
from router.dispatch.dispatcher import Dispatcher
from router.plan.epd import EPDPlanner
from router.errors import RouterError, body_too_large
from router.plan.image_fetch import ImageFetcher
from router.fleet.load import History, Sample
from router.fleet.membership import Membership
from router.metrics import Metrics
from router.plan.image_refs import RefImage, ref_images
from router.plan.images import ImagePart
from router.plan.videos import PublishedVideo, RefVideo, merged, ref_videos
from router.plan.limits import StageLimits, tightest
from router.plan.limits import body_too_large as stage_body_too_large
from router.plan.modes import ColocatedPlanner, PDPlanner, Planner
from router.fleet.pairing import Pairing
from router.fleet.registry import Registry
from router.fleet.scrape import sample_all, sample_loop
from router.dispatch.timeline import RoomLog
from router.upstream.client import Upstream
from router.fleet.workers import Pool, Worker, pairing_report
from telemetry import OFF, Tracing, start_tracing

log = logging.getLogger(__name__)
TRACING_SHUTDOWN_S = 5.0  # on close: spans still queued get this long to reach the collector


class StartupError(Exception):
    """The router cannot serve with the workers it was given; the message says why."""


class Router:
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.metrics = Metrics()
        self.registry = registry = Registry.for_config(config, self.metrics)
        self.upstream = Upstream(config)
        self.images = ImageFetcher(config)
        self.pairing = Pairing()
        self.rooms = RoomLog(config.room_history)
        self.history = History(config.ratio_window_s)
        registry.on_remove += [lambda worker: self.history.forget(worker.id), self.pairing.forget]
        self.membership = Membership(config, registry, self.upstream, self.pairing, self.learn_chat_schema)
        self.dns = DnsWatch(config, registry, self.membership, self.metrics) if config.discover else None
        self.epd: EPDPlanner | None = None
        planner: Planner
        if config.mode == "colocated":
            planner = ColocatedPlanner(registry.pools["colocated"])
        else:
            planner = PDPlanner(registry.pools["prefill"], registry.pools["decode"], self.pairing)
        if config.mode == "epd":
            planner = self.epd = _epd_planner(config, registry.pools["encoder"], planner, self.upstream)
        self.dispatcher = Dispatcher(config, planner, self.upstream, self.metrics, self.rooms)
        self.tracing: Tracing = OFF  # started once the workers are known (``_start``), shut down in ``close``
        self.in_flight = 0  # chat requests held now; the app's admission gate counts them
        self.metrics.in_flight.set_function(lambda: self.in_flight)
        self._loops: dict[str, asyncio.Task] = {}  # supervised: /health answers 503 if one dies
        self.chat_schema: dict | None = None  # router.openapi.chat_part of a stage, and its "source" URL
        self._published: tuple[dict[str, int], ...] | None = None  # stage_limits' memo: its input and result
        self._limits = StageLimits()

    @property
    def answering(self) -> Pool:
        """The role whose workers answer clients (and whose models the router lists)."""
        return self.registry.pools["colocated" if self.config.mode == "colocated" else "decode"]

    async def start(self) -> None:
        """Open the clients, discover, check, start the loops; if any of it raises, whatever was
        opened is closed again before the error goes on (``router.server`` closes only a started router)."""
        try:
            await self._start()
        except BaseException:
            await self.close()
            raise

    async def _start(self) -> None:
        deadline = time.monotonic() + self.config.startup_timeout_s
        await self.upstream.start()
        try:
            await discover(self.upstream.session, self.registry, self.config)
        except InfoError as exc:
            raise StartupError(str(exc)) from None
        if self.dns is not None:
            await self.dns.first_round(deadline)
        self._check_servable()
        if self.epd is not None:
            self.epd.fingerprint = self._vision_fingerprint()
        await self.learn_chat_schema([w for w in self.registry if w.known])
        session, config, pools = self.upstream.session, self.config, self.registry.pools
        if config.admin_token is not None and config.mode != "colocated":
            for prefill in [w for w in pools["prefill"].workers if w.known]:
                await self.membership.connect(prefill)
        self._spawn("health loop", health_loop(session, self.registry, config))
        self._spawn("load sampler", sample_loop(session, self.registry, self.metrics, self.history,
                                                config.health_timeout_s))
        if self.dns is not None:
            self._spawn("dns watch", self.dns.run())
        if config.auto_ratio_interval_s > 0 and config.mode != "colocated":
            self._spawn("auto ratio loop", auto_ratio_loop(self.membership, self.history, self.sample,
                                                           config.auto_ratio_interval_s, config.ratio_window_s,
                                                           config.auto_ratio_roles))
        model = next((card["id"] for card in self.models()), "")
        self.tracing = start_tracing(dataclasses.replace(config.tracing, instance_id=config.instance_id, model=model))
        log.info("%s router ready: %s", self.config.mode,
                 ", ".join(f"{len(p.workers)} {role} ({self.config.policy(role)})" for role, p in pools.items()))

    async def sample(self) -> dict[str, Sample]:
        """Read every known worker's ``/metrics`` into the load history now (``router.fleet.scrape``)."""
        return await sample_all(self.upstream.session, self.registry, self.metrics, self.history,
                                self.config.health_timeout_s)

    def _spawn(self, name: str, coro: Coroutine) -> None:
        task = self._loops[name] = asyncio.create_task(coro, name=name)
        task.add_done_callback(_report_death)

    async def close(self) -> None:
        for task in self._loops.values():
            task.cancel()
        await asyncio.gather(*self._loops.values(), return_exceptions=True)
        await self.images.close()
        await self.upstream.close()
        await asyncio.to_thread(self.tracing.shutdown, TRACING_SHUTDOWN_S)
        if self.epd is not None:
            await self.epd.aclose()

    def _check_servable(self) -> None:
        for role, pool in self.registry.pools.items():
            if not any(w.known for w in pool.workers):
                found = [s.label for s in self.config.dns_sources if s.role == role]
                raise StartupError(f"no {role} worker answered within {self.config.startup_timeout_s:g} s "
                                   f"(--startup-timeout-s): {[w.url for w in pool.workers] + found}")
        if self.config.mode == "colocated":
            return
        pairs, lines = pairing_report(self.registry.pools["prefill"], self.registry.pools["decode"])
        for line in lines:
            log.warning("%s", line)
        if pairs == 0:
            raise StartupError("no prefill and decode can be paired: " + "; ".join(lines))

    def _vision_fingerprint(self) -> str:
        """The one vision fingerprint of the encoders that answered (StartupError if they differ)."""
        found = {w.url: w.vision_fingerprint for w in self.registry.pools["encoder"].workers if w.known}
        if len(set(found.values())) != 1:
            raise StartupError("the encoders disagree on their vision fingerprint (their image keys would differ; "
                               "give --encoder servers of one model, dtype and image processor): "
                               + ", ".join(f"{url}: {fp}" for url, fp in found.items()))
        fingerprint = next(iter(found.values()))
        assert fingerprint is not None
        return fingerprint

    async def learn_chat_schema(self, workers: list[Worker]) -> None:
        """Until one is cached: the chat schema from the first of ``workers`` (an encoder has none)
        whose ``/openapi.json`` gives it. A stage that does not is logged and skipped."""
        for worker in workers:
            if self.chat_schema is not None:
                return
            if worker.role == "encoder":
                continue
            try:
                self.chat_schema = {**await read_chat_schema(self.upstream.session, worker,
                                                             self.config.health_timeout_s), "source": worker.url}
            except (InfoError, aiohttp.ClientError, TimeoutError, ValueError) as exc:
                log.warning("no chat schema from %s/openapi.json: %s: %s", worker.url, type(exc).__name__, exc)

    def stage_limits(self) -> StageLimits:
        """The tightest of the limits the known workers published (``router.plan.limits``): made again only
        when that set of published limits changed (discovery writes a new dict per reading)."""
        published = tuple(w.limits for w in self.registry if w.known and w.limits is not None)
        if published != self._published:  # dicts compare by identity first: equal once unchanged
            self._published, self._limits = published, tightest(published)
        return self._limits

    def body_cap(self, limits: StageLimits) -> tuple[int, Callable[[int | str, int], RouterError]]:
        """The largest chat body taken (``--max-body-mb``, or the stages' tighter limit in ``limits``, from
        ``stage_limits``), and the 413 for one over it (naming whose limit it is)."""
        stage = limits.max_body_bytes
        if stage is not None and stage < self.config.max_body_bytes:
            return stage, stage_body_too_large
        return self.config.max_body_bytes, body_too_large

    def max_images(self, limits: StageLimits) -> int:
        """The most images a chat request may have: ``--max-images-per-request``, or the stages' tighter limit."""
        stage = limits.max_images_per_request
        return min(self.config.max_images_per_request, stage or self.config.max_images_per_request)

    def max_videos(self, limits: StageLimits) -> int:
        """The most videos a chat request may have: ``--max-videos-per-request``, or the stages' tighter limit."""
        stage = limits.max_videos_per_request
        return min(self.config.max_videos_per_request, stage or self.config.max_videos_per_request)

    def video_support(self) -> tuple[bool | None, PublishedVideo | None]:
        """Whether the known workers take video, and the settings the router checks videos with
        (``router.plan.videos.merged``: None, None when no worker published its ``video``)."""
        return merged((w.takes_video, w.video) for w in self.registry if w.known)

    def video_refs(self, parts: list[ImagePart], video: PublishedVideo, overrides: object) -> tuple[RefVideo, ...]:
        """The request's video parts checked, probed and planned (epd: keyed under the encoders' vision
        fingerprint). Blocking (PyAV): the app calls it in a thread."""
        fingerprint = self.epd.fingerprint if self.epd is not None else None
        return ref_videos(parts, video, overrides, fingerprint)

    def image_refs(self, parts: list[ImagePart]) -> tuple[RefImage, ...]:
        """epd: the request's image parts with their cache keys and sizes (400/413 for a bad image);
        other modes: none (the stages read the images themselves)."""
        if self.epd is None or not parts:
            return ()
        assert self.epd.fingerprint is not None
        return tuple(ref_images(parts, self.epd.fingerprint, self.config.max_image_bytes))

    def failures(self) -> dict[str, str]:
        """Dead parts of the router itself (its supervised loops), by name."""
        return {name: "cancelled" if task.cancelled() else repr(task.exception() or "returned")
                for name, task in self._loops.items() if task.done()}

    def unservable(self) -> str | None:
        """Why no request can be served right now, or None."""
        if self.config.mode == "colocated":
            return None if self.answering.candidates() else "no healthy colocated worker"
        ps, ds = self.registry.pools["prefill"].candidates(), self.registry.pools["decode"].candidates()
        if any(self.pairing.pairable(p, d) for p in ps for d in ds):
            return None
        return (f"no healthy compatible prefill and decode pair allowed by the pairing rules "
                f"({self.pairing.rules.describe()}; {len(ps)} prefill, {len(ds)} decode healthy)")

    def serves(self, model: str) -> bool:
        """Whether ``model`` is among ``models()``' ids (without building the list: an answering worker's
        ``models`` are its cards' ids)."""
        return any(model in worker.models for worker in self.answering.workers)

    def models(self) -> list[dict]:
        """The model cards of the answering workers, each id once."""
        cards: dict[str, dict] = {}
        for worker in self.answering.workers:
            for card in worker.cards:
                cards.setdefault(card["id"], card)
        return list(cards.values())


def _report_death(task: asyncio.Task) -> None:
    """Log a loop's end unless it was stopped; ``/health`` reports it from then on."""
    exc = None if task.cancelled() else task.exception()
    if exc is not None:
        log.error("the %s died; /health answers 503 from now on", task.get_name(), exc_info=exc)


def _epd_planner(config: RouterConfig, encoders: Pool, pd: Planner, upstream: Upstream) -> EPDPlanner:
    assert config.redis_url is not None and isinstance(pd, PDPlanner)
    # the router only reads the index and takes claims: the byte budget is the writers' (encoders')
    cache = EmbeddingCache(CacheConfig(url=config.redis_url, budget_bytes=MIB, ttl_s=config.cache_ttl_s,
                                       op_timeout_s=config.cache_op_timeout_s))
    return EPDPlanner(encoders, pd, cache, upstream, config)
