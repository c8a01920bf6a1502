"""Changing the router's workers while it serves, where it takes talking to them: add, drain (and
wait until idle), switch a role, apply a prefill:decode split. The workers themselves, and the
changes that need no I/O (remove, resume, the role a switching worker is in), are the registry's
(``router.fleet.registry``). Called by the admin API (``router.admin.routes``) and the automatic ratio loop
(``router.admin.ratio_loop``), on the event loop.

Contracts:
- ``add`` admits a worker only after its ``/health``, ``/v1/models`` and ``/server_info`` answered
  as its role does and its fingerprint matches a worker of the role it pairs with; a misfit is a
  4xx ``RouterError`` saying why, and nothing changes. Its published limits count from then on, and
  the router takes the chat schema from its ``/openapi.json`` if it has none yet.
- A draining worker gets no new request; requests it holds finish.
- ``switch`` drains a switchable (``stage serve pd``) worker, waits until the router has nothing
  in flight on it, tells it its new role (``POST /role``), re-reads its info, and readmits it.
  Nothing is sent to it while it switches, so no request is lost or fails.
- Whenever a prefill joins (added, or switched to prefill) every decode is asked to allow its
  bootstrap address, and whenever a decode joins it is asked to allow every prefill
  (``POST /admin/allowed_bootstrap`` on the decode, with the router's admin token). A decode that
  refuses is never paired with that prefill; one whose admin API is disabled is trusted to allow
  it by its own ``--allowed-bootstrap`` (docs/admin.md).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import aiohttp

from contract.errors import Code
from contract.paths import HEALTH_PATH
from router.config import RouterConfig, check_worker_url
from router.fleet.discovery import InfoError, read_info
from router.errors import RouterError
from router.fleet.pairing import Pairing
from router.fleet.registry import Registry
from router.upstream.client import Upstream
from router.fleet.workers import Worker, compatible, fingerprint_diff

log = logging.getLogger(__name__)
POLL_S = 0.05  # how often a drain looks at the worker's outstanding count
LearnSchema = Callable[[list[Worker]], Awaitable[None]]  # take the chat schema from these, if none yet


class Membership:
    """The admin API's changes that talk to the workers; what they change is in ``registry``."""

    def __init__(self, config: RouterConfig, registry: Registry, upstream: Upstream, pairing: Pairing,
                 learn_schema: LearnSchema) -> None:
        self.config, self.registry, self.upstream, self.pairing = config, registry, upstream, pairing
        self._learn_schema = learn_schema
        self._switching = asyncio.Lock()  # one split at a time

    # --- add -----------------------------------------------------------------------------------
    async def add(self, url: str, role: str, group: str | None, source: str = "admin") -> dict:
        """Admit a worker from ``source`` (the registry's word for where it came from); its listing
        plus what each decode said about dialing (``dial``; none asked without an admin token)."""
        self.registry.check_new(url, role)
        try:
            check_worker_url(url, role)
        except ValueError:
            raise RouterError(400, f"url must be http://host:port (no path), got {url!r}", code="invalid_url",
                              param="url") from None
        worker = self.registry.new_worker(url, role, group)
        await self._admit(worker)
        self._check_fits(worker)
        worker.healthy = True
        self.registry.add(worker, source)
        await self._learn_schema([worker])
        log.info("%s: added %s %s as %s (group %s)", source, role, url, worker.id, worker.group)
        dial = await self.connect(worker) if self.config.admin_token is not None else {}
        return {"worker": worker_json(worker, source), "dial": dial}

    async def _admit(self, worker: Worker) -> None:
        session, config = self.upstream.session, self.config
        try:
            async with session.get(worker.url + HEALTH_PATH,
                                   timeout=aiohttp.ClientTimeout(total=config.health_timeout_s)) as response:
                if response.status != 200:
                    raise RouterError(409, f"{worker.url}/health answered HTTP {response.status}; add it once it is "
                                      "healthy", code="worker_unhealthy")
            await read_info(session, worker, config.health_timeout_s, config.admin_token)
        except InfoError as exc:
            raise RouterError(409, str(exc), code="worker_misfit") from None
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise RouterError(502, f"could not reach {worker.url}: {type(exc).__name__}: {exc}".rstrip(": "),
                              code="worker_unreachable") from None

    def _check_fits(self, worker: Worker) -> None:
        """A prefill or decode must share a fingerprint with a worker of the other role, if there is one;
        an encoder must have the other encoders' vision fingerprint (else its image keys differ)."""
        pools = self.registry.pools
        if worker.role == "encoder":
            known = [w for w in pools["encoder"].workers if w.known]
            if known and worker.vision_fingerprint != known[0].vision_fingerprint:
                raise RouterError(409, f"{worker.url} has vision fingerprint {worker.vision_fingerprint!r}, the "
                                  f"encoders {known[0].vision_fingerprint!r}: its image keys would differ",
                                  code="worker_misfit")
            return
        other = {"prefill": "decode", "decode": "prefill"}.get(worker.role)
        peers = [w for w in pools[other].workers if w.known] if other else []
        if peers and not any(compatible(worker, p) if worker.role == "prefill" else compatible(p, worker)
                             for p in peers):
            diff = "; ".join(fingerprint_diff(worker.fingerprint, peers[0].fingerprint))
            raise RouterError(409, f"{worker.url} can never be paired: its fingerprint matches no {other} "
                              f"(against {peers[0].id} {peers[0].url}: {diff})", code="worker_misfit")

    # --- dialing -------------------------------------------------------------------------------
    async def connect(self, worker: Worker) -> dict[str, str]:
        """Ask decodes to allow the prefills they may be paired with (see the module docstring);
        what each decode said, by "prefill id -> decode id"."""
        pools = self.registry.pools
        if worker.role == "prefill":
            pairs = [(worker, d) for d in pools["decode"].workers if d.known]
        elif worker.role == "decode":
            pairs = [(p, worker) for p in pools["prefill"].workers if p.known]
        else:
            return {}
        answers = await asyncio.gather(*(self._allow(p, d) for p, d in pairs))
        return {f"{p.id} -> {d.id}": answer for (p, d), answer in zip(pairs, answers)}

    async def _allow(self, prefill: Worker, decode: Worker) -> str:
        """Register ``prefill``'s bootstrap address with ``decode``; what came of it, in words. Anything
        but a 200 with a JSON object (or a 403 ``admin_disabled``) is a refusal: they are never paired."""
        assert prefill.bootstrap is not None
        host, port = prefill.bootstrap
        config, refused = self.config, self.pairing.refused
        headers = {"Authorization": f"Bearer {config.admin_token}"}
        try:
            async with self.upstream.session.post(
                decode.url + "/admin/allowed_bootstrap", json={"host": host, "port": port}, headers=headers,
                timeout=aiohttp.ClientTimeout(total=config.health_timeout_s)) as response:
                body = await response.json(content_type=None)
                status = response.status
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            body, status = {"error": {"message": f"{type(exc).__name__}: {exc}"}}, 0
        refused.discard((prefill.url, decode.url))
        if not isinstance(body, dict):
            body, status = {"error": {"message": f"decode {decode.id} ({decode.url}) answered HTTP {status} with "
                                                 f"a JSON {_json_kind(body)}, not an object"}}, 0
        if status == 200:
            return "registered" if body.get("added") else "already allowed"
        error = body["error"] if isinstance(body.get("error"), dict) else {}
        if status == 403 and error.get("code") == "admin_disabled":
            return ("not registered (the decode's admin API is disabled): its --allowed-bootstrap must allow "
                    f"{_host_port(host, port)}")
        refused.add((prefill.url, decode.url))
        log.warning("decode %s did not allow prefill %s:%d: %s; they are never paired", decode.url, host, port,
                    error.get("message"))
        return f"refused, never paired: {error.get('message') or f'HTTP {status}'}"

    # --- drain ---------------------------------------------------------------------------------
    async def drain(self, worker: Worker, wait_s: float) -> bool:
        """Stop sending ``worker`` new requests; wait up to ``wait_s`` for it to be idle. True if idle."""
        self.registry.drain(worker)
        return await self._idle(worker, wait_s)

    async def _idle(self, worker: Worker, wait_s: float) -> bool:
        deadline = time.monotonic() + wait_s
        while worker.outstanding and time.monotonic() < deadline:
            await asyncio.sleep(POLL_S)
        return worker.outstanding == 0

    # --- roles ---------------------------------------------------------------------------------
    async def apply_split(self, prefill: int, decode: int) -> list[dict]:
        """Switch switchable workers until there are ``prefill`` prefills and ``decode`` decodes; the
        switches made. RouterError (4xx) if the split cannot be reached, 409 while another is applied."""
        pools = self.registry.pools
        ps, ds = pools["prefill"].workers, pools["decode"].workers
        check_split(prefill, decode, ps, ds)
        if self._switching.locked():
            raise RouterError(409, "a split is being applied now; try again when it is done", code="split_in_progress")
        async with self._switching:
            source, target, count = ("decode", "prefill", prefill - len(ps)) if prefill > len(ps) else \
                ("prefill", "decode", len(ps) - prefill)
            candidates = [w for w in pools[source].workers if w.switchable and not w.draining]
            if len(candidates) < count:
                raise RouterError(409, f"{count} {source} worker(s) must switch, but only {len(candidates)} are "
                                  "switchable and not drained (resume drained ones first)", code="split_unreachable")
            movers = sorted(candidates, key=lambda w: (w.outstanding, w.id))[:count]
            return list(await asyncio.gather(*(self.switch(w, target) for w in movers)))

    async def switch(self, worker: Worker, role: str) -> dict:
        """Drain ``worker``, switch it to ``role`` and readmit it (see the module docstring)."""
        config, started, previous = self.config, time.monotonic(), worker.role
        self.registry.begin_switch(worker)
        try:
            if not await self._idle(worker, config.drain_timeout_s):
                raise RouterError(504, f"{worker.id} still had {worker.outstanding} request(s) in flight after "
                                  f"{config.drain_timeout_s:g} s (--drain-timeout-s); it keeps its role",
                                  code=Code.DRAIN_TIMEOUT)
            self.registry.move(worker, role)
            try:
                await self._tell_role(worker, started + config.drain_timeout_s)
                await read_info(self.upstream.session, worker, config.health_timeout_s, config.admin_token)
            except BaseException:
                self.registry.move(worker, previous)
                raise
            dial = await self.connect(worker)
        finally:
            self.registry.end_switch(worker)
        log.info("admin: %s %s switched from %s to %s in %.2f s", worker.id, worker.url, previous, role,
                 time.monotonic() - started)
        return {"id": worker.id, "from": previous, "to": role, "seconds": time.monotonic() - started, "dial": dial}

    async def _tell_role(self, worker: Worker, deadline: float) -> None:
        """``POST /role`` until the worker takes it (it refuses while it still has work) or ``deadline``."""
        while True:
            status, message = await post_role(self.upstream.session, worker, self.config)
            if status == 200:
                return
            if status != 409 or time.monotonic() >= deadline:
                raise RouterError(502, f"{worker.id} ({worker.url}) did not take the role {worker.role}: {message}",
                                  code="switch_failed")
            await asyncio.sleep(POLL_S * 2)


async def post_role(session: aiohttp.ClientSession, worker: Worker, config: RouterConfig) -> tuple[int, str]:
    """Tell a switchable worker to serve ``worker.role``; (HTTP status, error message). 0: unreachable."""
    try:
        async with session.post(worker.url + "/role", json={"role": worker.role},
                                headers={"Authorization": f"Bearer {config.admin_token}"},
                                timeout=aiohttp.ClientTimeout(total=config.health_timeout_s * 5)) as response:
            body = await response.json(content_type=None)
            error = body.get("error") if isinstance(body, dict) else None
            return response.status, (error or {}).get("message", "") if isinstance(error, dict) else ""
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        return 0, f"{type(exc).__name__}: {exc}"


def check_split(prefill: object, decode: object, prefills: list[Worker], decodes: list[Worker]) -> None:
    """RouterError (400/409) unless ``prefill``:``decode`` can be reached by switching switchable workers."""
    total = len(prefills) + len(decodes)
    if not (isinstance(prefill, int) and isinstance(decode, int)) or isinstance(prefill, bool) or \
            isinstance(decode, bool) or prefill < 1 or decode < 1:
        raise RouterError(400, 'a split is {"prefill": n, "decode": m}, each an integer >= 1', code="invalid_split")
    if prefill + decode != total:
        raise RouterError(400, f"the pool has {total} prefill and decode workers; prefill + decode must be {total}, "
                          f"got {prefill} + {decode}", code="invalid_split")
    fixed_p = sum(not w.switchable for w in prefills)
    fixed_d = sum(not w.switchable for w in decodes)
    if prefill < fixed_p or decode < fixed_d:
        raise RouterError(409, f"only switchable workers (stage serve pd) change roles: {fixed_p} prefill and "
                          f"{fixed_d} decode workers are fixed, so prefill must be >= {fixed_p} and decode >= "
                          f"{fixed_d}", code="split_unreachable")


def _json_kind(value: object) -> str:
    """The JSON name of a decoded value's type."""
    kinds = {bool: "boolean", int: "number", float: "number", str: "string", list: "array", type(None): "null"}
    return kinds.get(type(value), type(value).__name__)


def worker_json(worker: Worker, source: str) -> dict:
    """What the router itself knows of a worker, and its ``source`` (``Registry.source``); the admin
    listing adds the stage's load."""
    return {"id": worker.id, "role": worker.role, "url": worker.url, "source": source, "healthy": worker.healthy,
            "known": worker.known, "circuit": worker.breaker.state.name.lower(), "outstanding": worker.outstanding,
            "group": worker.group, "draining": worker.draining, "switchable": worker.switchable,
            "bootstrap": _host_port(*worker.bootstrap) if worker.bootstrap else None}


def _host_port(host: str, port: int) -> str:
    """``host:port``, an IPv6 literal bracketed (as ``process.addresses.host_port``, which the router may
    not import)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
