"""The admin API's routes (``docs/admin.md``), on the router's own app and port. Every route checks the
bearer token first (``router.admin.auth``); the work is in ``registry`` (the workers: listed, found,
resumed, removed), ``membership`` (added, drained, switched), ``pairing``, ``ratio_loop`` and ``rooms``.

    GET    /admin/workers                      every worker, with its stage's queue and KV blocks
    POST   /admin/workers                      {"url", "role", "group"?}: add one
    POST   /admin/workers/{id}/drain?wait_s=S  no new work; answers once idle (200) or after S s (202)
    POST   /admin/workers/{id}/resume          takes new work again
    POST   /admin/workers/{id}/role            {"role"}: switch one switchable worker to it
    DELETE /admin/workers/{id}?force=true      remove (refused while it has requests in flight)
    GET    /admin/pairing, PUT /admin/pairing  the pairing rules and what they allow
    GET    /admin/ratio?window_s=S             load, capacity and the recommended split
    POST   /admin/ratio                        {"prefill": n, "decode": m} or (epd) {"encoder": e, ...}:
                                               switch workers to it
    GET    /admin/rooms?slowest=N              the slowest recent rooms
    GET    /admin/rooms/{room}                 one room across the stages
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import msgspec

from contract.errors import Code
from contract.json_depth import TOO_DEEP, too_deep
from router.admin.auth import refusal
from router.admin.ratio_loop import report
from router.admin.rooms import room_view
from router.errors import RouterError, bad_request
from router.http import Request, Response, Routes, json_response
from router.fleet.membership import worker_json
from router.fleet.pairing import PairingRules
from router.runtime import Router

log = logging.getLogger(__name__)
AdminHandler = Callable[[Router, Request], Awaitable[Response]]
PD_SPLIT = 'a split is {"prefill": n, "decode": m}'
EPD_SPLIT = PD_SPLIT + ' (the encoders stay) or {"encoder": e, "prefill": n, "decode": m}'


def add_admin_routes(table: Routes, router: Router) -> None:
    """The admin routes over ``router``, each behind the token check."""
    routes = [("GET", "/admin/workers", _workers), ("POST", "/admin/workers", _add),
              ("POST", "/admin/workers/{id}/drain", _drain), ("POST", "/admin/workers/{id}/resume", _resume),
              ("POST", "/admin/workers/{id}/role", _switch_role),
              ("DELETE", "/admin/workers/{id}", _remove), ("GET", "/admin/pairing", _pairing),
              ("PUT", "/admin/pairing", _set_pairing), ("GET", "/admin/ratio", _ratio),
              ("POST", "/admin/ratio", _apply_ratio), ("GET", "/admin/rooms", _rooms),
              ("GET", "/admin/rooms/{room}", _room)]
    for method, path, handler in routes:
        table.add(method, path, _guarded(router, handler))


def _guarded(router: Router, handler: AdminHandler) -> Callable[[Request], Awaitable[Response]]:
    async def guarded(request: Request) -> Response:
        refused = refusal(router.config.admin_token, request.headers.get("Authorization"))
        if refused is not None:
            raise refused
        return await handler(router, request)

    return guarded


# --- workers -----------------------------------------------------------------------------------
async def _workers(router: Router, request: Request) -> Response:
    samples = await router.sample()
    listing = []
    for worker in router.registry:
        sample = samples.get(worker.id)
        listing.append({**worker_json(worker, router.registry.source(worker)),
                        "queue_depth": sample.queue_depth if sample else None,
                        "running": sample.running if sample else None,
                        "kv_blocks_used": sample.kv_blocks_used if sample else None})
    return json_response({"mode": router.config.mode, "workers": listing})


async def _add(router: Router, request: Request) -> Response:
    body = await _json(request)
    url, role, group = body.get("url"), body.get("role"), body.get("group")
    if not isinstance(url, str) or not isinstance(role, str):
        raise bad_request('adding a worker takes {"url": "http://host:port", "role": ROLE, "group"?: LABEL}',
                          param=None, code=Code.INVALID_VALUE)
    if group is not None and (not isinstance(group, str) or not group.strip()):
        raise bad_request("group must be a non-empty string", "group", Code.INVALID_VALUE)
    return json_response(await router.membership.add(url, role, group))


async def _drain(router: Router, request: Request) -> Response:
    worker = router.registry.find(request.match_info["id"])
    wait_s = _number(request, "wait_s", router.config.drain_timeout_s)
    idle = await router.membership.drain(worker, wait_s)
    return json_response({"worker": worker_json(worker, router.registry.source(worker)), "idle": idle},
                             status=200 if idle else 202)


async def _resume(router: Router, request: Request) -> Response:
    worker = router.registry.find(request.match_info["id"])
    router.registry.resume(worker)
    return json_response({"worker": worker_json(worker, router.registry.source(worker))})


async def _switch_role(router: Router, request: Request) -> Response:
    worker = router.registry.find(request.match_info["id"])
    body = await _json(request)
    if set(body) != {"role"}:
        raise bad_request('switching a worker takes {"role": ROLE}', param=None, code="invalid_role")
    switched = await router.membership.switch_role(worker, body["role"])
    return json_response({"worker": worker_json(worker, router.registry.source(worker)), "switched": switched})


async def _remove(router: Router, request: Request) -> Response:
    worker = router.registry.find(request.match_info["id"])
    force = request.query.get("force", "false").lower() in ("1", "true", "yes")
    source = router.registry.source(worker)
    router.registry.remove(worker, force)
    log.info("admin: removed %s %s (%s), %d request(s) in flight", worker.role, worker.url, worker.id,
             worker.outstanding)
    return json_response({"removed": worker_json(worker, source)})


# --- pairing -----------------------------------------------------------------------------------
async def _pairing(router: Router, request: Request) -> Response:
    return json_response(_pairing_view(router))


async def _set_pairing(router: Router, request: Request) -> Response:
    try:
        rules = PairingRules.from_json(await _json(request))
    except ValueError as exc:
        raise bad_request(str(exc), param=None, code="invalid_pairing") from None
    router.pairing.rules = rules
    return json_response(_pairing_view(router))


def _pairing_view(router: Router) -> dict:
    pairs = []
    pools = router.registry.pools
    prefills, decodes = (pools[role].workers if role in pools else [] for role in ("prefill", "decode"))
    for p in prefills:
        for d in decodes:
            why = router.pairing.why_not(p, d)
            pairs.append({"prefill": p.id, "decode": d.id, "allowed": why is None, "why_not": why})
    return {"rules": router.pairing.rules.to_json(), "describe": router.pairing.rules.describe(),
            "allowed_pairs": sum(pair["allowed"] for pair in pairs), "pairs": pairs}


# --- ratio -------------------------------------------------------------------------------------
async def _ratio(router: Router, request: Request) -> Response:
    window = min(_number(request, "window_s", router.config.ratio_window_s), router.config.ratio_window_s)
    await router.sample()
    return json_response(report(router.registry, router.history, window))


async def _apply_ratio(router: Router, request: Request) -> Response:
    if router.config.mode == "colocated":
        raise RouterError(400, "colocated mode has no prefill:decode split", code="invalid_split")
    body, epd = await _json(request), router.config.mode == "epd"
    if set(body) != {"prefill", "decode"} and not (epd and set(body) == {"encoder", "prefill", "decode"}):
        raise bad_request(EPD_SPLIT if epd else PD_SPLIT, param=None, code="invalid_split")
    switched = await router.membership.apply_split(body)
    current = {role: len(pool.workers) for role, pool in router.registry.pools.items() if role in body}
    return json_response({**current, "switched": switched})


# --- rooms -------------------------------------------------------------------------------------
async def _rooms(router: Router, request: Request) -> Response:
    slowest = int(_number(request, "slowest", 10))
    return json_response({"kept": len(router.rooms), "capacity": router.rooms.capacity,
                              "rooms": [r.to_json() for r in router.rooms.slowest(slowest)]})


async def _room(router: Router, request: Request) -> Response:
    text = request.match_info["room"]
    record = router.rooms.get(int(text)) if text.isascii() and text.isdigit() else None  # not "²"
    if record is None:
        raise RouterError(404, f"room {text} is not among the last {router.rooms.capacity} rooms "
                          "(--room-history)", code=Code.ROOM_NOT_FOUND)
    return json_response(await room_view(router.upstream.session, record, router.config.health_timeout_s))


# --- helpers -----------------------------------------------------------------------------------
async def _json(request: Request) -> dict:
    raw = await request.read()
    if too_deep(raw):
        raise bad_request(TOO_DEEP, param=None, code=Code.INVALID_JSON)
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise bad_request(f"The request body is not valid JSON: {exc}", param=None, code=Code.INVALID_JSON) from None
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.", param=None, code=Code.INVALID_JSON)
    return body


def _number(request: Request, name: str, default: float) -> float:
    text = request.query.get(name)
    if text is None:
        return default
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise bad_request(f"?{name}= takes a number >= 0, got {text!r}", name, Code.INVALID_VALUE)
    return value
