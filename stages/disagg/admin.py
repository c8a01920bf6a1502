"""A stage server's admin routes, for the router: the same bearer-token rule as the router's admin API
(``--admin-token`` or ``EPD_ADMIN_TOKEN``; without one, 403 "admin API disabled"; a wrong or
missing token, 401; compared in constant time).

    POST /admin/allowed_bootstrap {"host", "port"}   decode (and a switchable worker): also allow
                                                     dialing the prefill at host:port
    POST /role {"role"}                              switchable worker (``stages.disagg.switchable``)

Why the decode has it: a decode dials only the prefills ``--allowed-bootstrap`` allows (default
loopback). When the router adds a prefill at runtime, it registers the prefill's bootstrap address
with each decode here, so decodes need no allow-list wide enough for any future prefill. The
alternative, for decodes started without a token, is an ``--allowed-bootstrap`` CIDR covering
every address a prefill may ever have (docs/admin.md).
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Callable

from fastapi import FastAPI, Request

from contract.errors import Code
from stages.api.errors import APIError
from stages.api.json_depth import check_json_depth
from process.addresses import host_port
from transfer.peer_policy import AllowList

DISABLED = ("admin API disabled: start the server with --admin-token or the EPD_ADMIN_TOKEN environment variable "
            "(the router's token)")
SCHEME = "Bearer "


def check_admin(token: str | None, request: Request) -> None:
    """Raise 403 if the admin API is disabled, 401 unless the request carries the token."""
    if token is None:
        raise APIError(403, DISABLED, code="admin_disabled")
    header = request.headers.get("authorization") or ""
    given = header[len(SCHEME):] if header.startswith(SCHEME) else ""
    if not hmac.compare_digest(given.encode(), token.encode()):
        raise APIError(401, "wrong admin token" if given else "missing admin token: send Authorization: Bearer <token>",
                       code="unauthorized", headers={"WWW-Authenticate": "Bearer"})


def add_bootstrap_route(app: FastAPI, token: str | None, allow: Callable[[], AllowList]) -> None:
    """``POST /admin/allowed_bootstrap``: allow ``host:port`` on the current decode's ``allow()`` list
    (unless it already allows it); answers ``{"added", "allowed"}``."""

    @app.post("/admin/allowed_bootstrap", include_in_schema=False)
    async def allowed_bootstrap(request: Request) -> dict:
        check_admin(token, request)
        body = await read_json(request)
        host, port = body.get("host"), body.get("port")
        if not isinstance(host, str) or not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
            raise APIError(400, 'allowing a prefill takes {"host": str, "port": 1-65535}', code=Code.INVALID_VALUE)
        allow_list = allow()
        if allow_list.allows(host, port):
            return {"added": False, "allowed": list(allow_list.patterns())}
        try:
            allow_list.add(host_port(host, port))
        except ValueError as exc:
            raise APIError(400, str(exc), param="host", code=Code.INVALID_VALUE) from None
        return {"added": True, "allowed": list(allow_list.patterns())}


async def read_json(request: Request) -> dict:
    """The request's JSON object body, or 400 ``invalid_json`` (nested too deep included)."""
    raw = await request.body()
    check_json_depth(raw)
    try:
        body = json.loads(raw)
    except ValueError:
        raise APIError(400, "The request body is not valid JSON.", code=Code.INVALID_JSON) from None
    if not isinstance(body, dict):
        raise APIError(400, "The request body must be a JSON object.", code=Code.INVALID_JSON)
    return body
