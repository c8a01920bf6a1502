"""What the router learns from its workers, and keeps checking: their models, fingerprints, bootstrap
addresses, request limits and video settings (``/v1/models``, ``/server_info``), the chat request's schema (their
``/openapi.json``, read once by ``router.runtime``) and their health (``/health``).

Contract: ``discover`` runs at startup for every worker (until each answers, or the startup
deadline); ``health_loop`` runs for the router's whole life as a supervised task: every
``--health-interval-s`` it asks every worker's ``/health`` (each within ``--health-timeout-s``),
marks it healthy or not, and re-reads a worker's info when it comes back (a restarted prefill may
have a new bootstrap port). A stage shutting down answers 503 ``{"status": "draining"}``: out of
rotation from that check on (health checks never touch a breaker), back once it answers 200 (a
pod that came back). Only these functions write a worker's info and (with the dispatcher,
which marks a worker it could not reach) its ``healthy`` flag.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from urllib.parse import urlsplit

import aiohttp

from contract.paths import HEALTH_PATH, OPENAPI_PATH, SERVER_INFO_PATH
from router.config import RouterConfig
from router.plan.limits import published
from router.plan.videos import video_published
from router.openapi import chat_part
from router.fleet.workers import Worker

log = logging.getLogger(__name__)
WILDCARDS = ("0.0.0.0", "::", "")
SWITCHED = ("encoder", "prefill", "decode")  # the roles a switchable worker is told, and checked for


class InfoError(Exception):
    """A worker answered, but not as a stage of its role does."""


async def _get_json(session: aiohttp.ClientSession, url: str, timeout_s: float) -> dict:
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
        if response.status != 200:
            raise InfoError(f"GET {url} answered HTTP {response.status}")
        body = await response.json(content_type=None)
    if not isinstance(body, dict):
        raise InfoError(f"GET {url} did not answer a JSON object")
    return body


async def read_info(session: aiohttp.ClientSession, worker: Worker, timeout_s: float, token: str | None) -> None:
    """Fill in ``worker``'s models and request limits (all roles), switchability and the roles it can
    take (all roles), fingerprint and group (prefill, decode), bootstrap address (prefill), and encoder
    id and vision fingerprint (encoder; a prefill that can encode its own images), clearing what its
    role has not. A switchable worker serving another role, or none yet, is told ``worker.role``
    first, with the router's admin ``token``. Raises InfoError, aiohttp.ClientError or TimeoutError."""
    info = await _role_info(session, worker, timeout_s, token)
    if worker.role == "encoder":
        _take_encoder(worker, info)
    else:
        await _take_stage(session, worker, info, timeout_s)
    worker.switchable = info.get("switchable") is True
    roles = info.get("roles") if worker.switchable else None
    worker.roles = tuple(role for role in roles if isinstance(role, str)) if isinstance(roles, list) else ()
    worker.limits = published(info)
    worker.known = True


async def _role_info(session: aiohttp.ClientSession, worker: Worker, timeout_s: float, token: str | None) -> dict:
    """``worker``'s ``/server_info`` once it serves ``worker.role`` (a switchable one is told it first);
    InfoError if it is a server of another role."""
    info = await _get_json(session, worker.url + SERVER_INFO_PATH, timeout_s)
    if worker.role not in SWITCHED:
        return info
    if info.get("switchable") is True and info.get("role") != worker.role:
        await _assign_role(session, worker, timeout_s, token)
        info = await _get_json(session, worker.url + SERVER_INFO_PATH, timeout_s)
    if info.get("role") != worker.role:
        raise InfoError(f"{worker.url} is a {info.get('role')!r} server, given as --{worker.role}")
    return info


def _take_encoder(worker: Worker, info: dict) -> None:
    """An encoder has no ``/v1/models``: its ``/server_info`` names its model, id and vision fingerprint.
    What a switchable worker had as a prefill or decode is cleared."""
    names = ("model", "encoder_id", "vision_fingerprint")
    fields = {name: value for name in names if isinstance(value := info.get(name), str) and value}
    lacking = sorted(set(names) - set(fields))
    if lacking:
        raise InfoError(f"{worker.url}/server_info lacks {lacking}")
    worker.models, worker.cards = (fields["model"],), ()
    worker.encoder_id, worker.vision_fingerprint = fields["encoder_id"], fields["vision_fingerprint"]
    worker.fingerprint, worker.bootstrap, worker.takes_video, worker.video = None, None, None, None


async def _take_stage(session: aiohttp.ClientSession, worker: Worker, info: dict, timeout_s: float) -> None:
    """A prefill's, decode's or colocated server's models (``/v1/models``), fingerprint, bootstrap
    address (prefill), video settings and group, and a prefill's local encoder (else none)."""
    models = await _get_json(session, worker.url + "/v1/models", timeout_s)
    cards = tuple(card for card in models.get("data") or () if isinstance(card, dict) and "id" in card)
    fingerprint, bootstrap = None, None
    if worker.role in ("prefill", "decode"):
        fingerprint = info.get("fingerprint")
        if not isinstance(fingerprint, dict):
            raise InfoError(f"{worker.url}/server_info has no fingerprint")
    if worker.role == "prefill":
        bootstrap = _bootstrap(worker, info.get("bootstrap"))
    worker.cards, worker.models = cards, tuple(card["id"] for card in cards)
    worker.fingerprint, worker.bootstrap = fingerprint, bootstrap
    worker.encoder_id, worker.vision_fingerprint = _local_encoder(info) if worker.role == "prefill" else (None, None)
    worker.takes_video, worker.video = video_published(info)
    if worker.group is None and isinstance(info.get("group"), str):
        worker.group = info["group"]


def _local_encoder(info: dict) -> tuple[str | None, str | None]:
    """A prefill's ``encoder_id`` and ``vision_fingerprint``, published when it encodes its own images
    (an EPD switchable worker); (None, None) when it does not publish both as strings."""
    encoder_id, vision = info.get("encoder_id"), info.get("vision_fingerprint")
    return (encoder_id, vision) if isinstance(encoder_id, str) and isinstance(vision, str) else (None, None)


async def read_chat_schema(session: aiohttp.ClientSession, worker: Worker, timeout_s: float) -> dict:
    """The chat route's request and answer schemas in ``worker``'s ``/openapi.json``
    (``router.openapi.chat_part``). Raises InfoError, aiohttp.ClientError or TimeoutError."""
    document = await _get_json(session, worker.url + OPENAPI_PATH, timeout_s)
    try:
        return chat_part(document)
    except (KeyError, TypeError, AttributeError) as exc:
        raise InfoError(f"{worker.url}/openapi.json has no chat route schema ({type(exc).__name__}: {exc})") from None


async def _assign_role(session: aiohttp.ClientSession, worker: Worker, timeout_s: float, token: str | None) -> None:
    if token is None:
        raise InfoError(f"{worker.url} is a switchable worker (stage serve pd); the router assigns its role "
                        "with its admin token: start the router with --admin-token, the same as the worker's")
    async with session.post(worker.url + "/role", json={"role": worker.role},
                            headers={"Authorization": f"Bearer {token}"},
                            timeout=aiohttp.ClientTimeout(total=timeout_s * 5)) as response:
        if response.status != 200:
            raise InfoError(f"{worker.url} did not take the role {worker.role} (HTTP {response.status}): "
                            f"{(await response.text())[:300]}")
    log.info("%s is now a %s (switchable worker)", worker.url, worker.role)


def _bootstrap(worker: Worker, entry: object) -> tuple[str, int]:
    """The prefill's bootstrap endpoint as a decode dials it: a wildcard bind address becomes the
    host the router reaches the prefill at."""
    if not isinstance(entry, dict) or not isinstance(port := entry.get("port"), int):
        raise InfoError(f"{worker.url}/server_info has no bootstrap address")
    host = entry.get("host")
    if not isinstance(host, str) or host in WILDCARDS:
        host = urlsplit(worker.url).hostname or ""
    return host, port


async def check(session: aiohttp.ClientSession, worker: Worker, config: RouterConfig) -> InfoError | None:
    """One health check of one worker; updates ``worker.healthy`` (and its info when it comes back).
    Returns the InfoError if it answered but not as a stage of its role does."""
    misfit = None
    try:
        async with session.get(worker.url + HEALTH_PATH,
                               timeout=aiohttp.ClientTimeout(total=config.health_timeout_s)) as response:
            ok = response.status == 200
            reason = f"/health answered HTTP {response.status}"
            if response.status == 503 and await _draining(response):
                reason = "it is draining (shutting down): out of rotation, its breaker untouched"
        if ok and not (worker.healthy and worker.known):
            await read_info(session, worker, config.health_timeout_s, config.admin_token)
    except InfoError as exc:
        ok, reason, misfit = False, str(exc), exc
    except TimeoutError:
        worker.late_checks += 1
        if worker.late_checks < config.health_timeouts:
            return None  # late, not gone: the verdict stands until --health-timeouts checks in a row are
        ok, reason = False, f"{worker.late_checks} health checks in a row took over {config.health_timeout_s:g} s"
    except (aiohttp.ClientError, ValueError) as exc:
        ok, reason = False, f"{type(exc).__name__}: {exc}"
    if ok:
        worker.late_checks = 0
    if ok != worker.healthy:
        if ok:
            log.info("%s %s is healthy", worker.role, worker.url)
        else:
            log.warning("%s %s is unhealthy: %s", worker.role, worker.url, reason)
    worker.healthy = ok
    return misfit


async def _draining(response: aiohttp.ClientResponse) -> bool:
    """A stage's /health 503 that says ``{"status": "draining"}`` (it got SIGTERM; docs/protocol.md
    "Draining"): out of rotation like any unhealthy answer, and said so in the log."""
    try:
        body = await response.json(content_type=None)
    except (aiohttp.ClientError, ValueError):
        return False
    return isinstance(body, dict) and body.get("status") == "draining"


async def discover(session: aiohttp.ClientSession, workers: Iterable[Worker], config: RouterConfig) -> None:
    """At startup: check every worker until each is healthy and known, or ``--startup-timeout-s``
    has passed (those still unknown stay out of rotation until the health loop reaches them).
    Raises InfoError at once if a worker answers but is not a stage of the role it was given as."""
    deadline = time.monotonic() + config.startup_timeout_s
    while True:
        waiting = [w for w in workers if not (w.healthy and w.known)]
        misfits = [m for m in await asyncio.gather(*(check(session, w, config) for w in waiting)) if m is not None]
        if misfits:
            raise InfoError("; ".join(str(m) for m in misfits))
        waiting = [w for w in workers if not (w.healthy and w.known)]
        if not waiting or time.monotonic() >= deadline:
            for w in waiting:
                log.warning("%s %s did not answer at startup; it joins once its /health answers", w.role, w.url)
            return
        await asyncio.sleep(min(config.health_interval_s, 0.5))


async def health_loop(session: aiohttp.ClientSession, workers: Iterable[Worker], config: RouterConfig) -> None:
    """Forever: check every worker (``workers`` is read afresh each round: the router's registry), then
    sleep ``--health-interval-s``."""
    while True:
        await asyncio.gather(*(check(session, w, config) for w in workers))
        await asyncio.sleep(config.health_interval_s)
