"""Changing the router's workers while it serves, where it takes talking to them: add, drain (and
wait until idle), switch a role, apply an E:P:D or P:D split. The workers themselves, and the
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
  in flight on it, tells it its new role (``POST /role``: prefill, decode, or encoder for one whose
  ``/server_info`` ``roles`` has it), re-reads its info, checks it fits its new role as ``add`` does
  (an encoder's vision fingerprint is the other encoders', which is the router's), and readmits it; a
  misfit is switched back. Nothing is sent to it while it switches, so no request is lost or fails.
  One split (``apply_split``) or single switch (``switch_role``) at a time.
- Whenever a prefill joins (added, or switched to prefill) every decode is asked to allow its
  bootstrap address, and whenever a decode joins it is asked to allow every prefill
  (``POST /admin/allowed_bootstrap`` on the decode, with the router's admin token). A decode that
  refuses is never paired with that prefill; one whose admin API is disabled is trusted to allow
  it by its own ``--allowed-bootstrap`` (docs/admin.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping

import aiohttp

from contract.errors import Code
from contract.paths import HEALTH_PATH
from router.config import RouterConfig, check_worker_url
from router.fleet.discovery import InfoError, read_info
from router.errors import RouterError
from router.fleet.pairing import Pairing
from router.fleet.registry import Registry
from router.upstream.client import Upstream
from router.fleet.splits import check_split, check_switch, movers
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
        self._switching = asyncio.Lock()  # one split or role switch at a time

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
            known = [w for w in pools["encoder"].workers
                     if w.known and w is not worker and not self.registry.switching(w)]
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
    async def apply_split(self, split: Mapping[str, object]) -> list[dict]:
        """Switch switchable workers until each role of ``split`` (a count per role, some of this
        router's encoder, prefill and decode) has that many workers; roles not in it keep theirs. All
        the switches run at once (``movers`` picks them); the switches made. RouterError (4xx) if the
        split cannot be reached, 409 ``split_in_progress`` while another split or switch is applied."""
        pools = {role: pool.workers for role, pool in self.registry.pools.items() if role in split}
        counts = check_split(split, pools)
        async with self._one_at_a_time():
            moves = movers(counts, pools)
            return list(await asyncio.gather(*(self.switch(w, role) for w, role in moves)))

    async def switch_role(self, worker: Worker, role: object) -> dict | None:
        """Switch one worker to ``role`` (``switch``); None when it serves ``role`` already. RouterError
        (4xx, ``check_switch``) if it may not, 409 ``split_in_progress`` while a split or switch is applied."""
        target = check_switch(worker, role, self.registry.pools)
        if target is None:
            return None
        async with self._one_at_a_time():
            return await self.switch(worker, target)

    @contextlib.asynccontextmanager
    async def _one_at_a_time(self) -> AsyncIterator[None]:
        if self._switching.locked():
            raise RouterError(409, "a split or role switch is being applied now; try again when it is done",
                              code="split_in_progress")
        async with self._switching:
            yield

    async def switch(self, worker: Worker, role: str) -> dict:
        """Drain ``worker``, switch it to ``role`` and readmit it (see the module docstring). One that
        does not fit its new role (``_check_fits``: an encoder of another vision fingerprint, a prefill
        or decode no peer pairs with) is switched back, and the misfit raised (409 ``worker_misfit``)."""
        config, started, previous = self.config, time.monotonic(), worker.role
        self.registry.begin_switch(worker)
        try:
            if not await self._idle(worker, config.drain_timeout_s):
                raise RouterError(504, f"{worker.id} still had {worker.outstanding} request(s) in flight after "
                                  f"{config.drain_timeout_s:g} s (--drain-timeout-s); it keeps its role",
                                  code=Code.DRAIN_TIMEOUT)
            misfit = await self._take_role(worker, role, previous, started + config.drain_timeout_s)
            if misfit is not None:
                await self._take_role(worker, previous, previous, time.monotonic() + config.drain_timeout_s)
                await self.connect(worker)
                raise RouterError(409, f"{misfit.message}; it was switched back to {previous}", code="worker_misfit")
            dial = await self.connect(worker)
        finally:
            self.registry.end_switch(worker)
        log.info("admin: %s %s switched from %s to %s in %.2f s", worker.id, worker.url, previous, role,
                 time.monotonic() - started)
        return {"id": worker.id, "from": previous, "to": role, "seconds": time.monotonic() - started, "dial": dial}

    async def _take_role(self, worker: Worker, role: str, previous: str, deadline: float) -> RouterError | None:
        """Move switching ``worker`` to ``role``'s pool, tell it (``POST /role``, until ``deadline``) and
        re-read its info; back in ``previous``'s pool if that fails. The misfit if it does not fit there."""
        config = self.config
        self.registry.move(worker, role)
        try:
            await self._tell_role(worker, deadline)
            await read_info(self.upstream.session, worker, config.health_timeout_s, config.admin_token)
        except BaseException:
            self.registry.move(worker, previous)
            raise
        try:
            self._check_fits(worker)
        except RouterError as misfit:
            return misfit
        return None

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
            "roles": list(worker.roles),
            "bootstrap": _host_port(*worker.bootstrap) if worker.bootstrap else None}


def _host_port(host: str, port: int) -> str:
    """``host:port``, an IPv6 literal bracketed (as ``process.addresses.host_port``, which the router may
    not import)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
