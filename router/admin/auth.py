"""Who may call ``/admin/*``: the holder of the router's admin token. Pure.

The token is ``--admin-token`` or ``EPD_ADMIN_TOKEN``. Without one the admin API is disabled and
answers 403 to everyone (it never answers open); with one, a request must carry
``Authorization: Bearer <token>``, compared in constant time (``hmac.compare_digest``), else 401.
The OpenAI routes never look at it.
"""

from __future__ import annotations

import hmac

from router.errors import RouterError

DISABLED = ("admin API disabled: start the router with --admin-token or the EPD_ADMIN_TOKEN environment variable "
            "(stage up takes the same flag and variable)")
SCHEME = "Bearer "


def refusal(token: str | None, authorization: str | None) -> RouterError | None:
    """Why a request with this ``Authorization`` header may not use the admin API, or None if it may."""
    if token is None:
        return RouterError(403, DISABLED, code="admin_disabled")
    given = authorization[len(SCHEME):] if authorization and authorization.startswith(SCHEME) else ""
    if not hmac.compare_digest(given.encode(), token.encode()):
        why = "wrong admin token" if given else "missing admin token: send Authorization: Bearer <token>"
        return RouterError(401, why, code="unauthorized", headers={"WWW-Authenticate": "Bearer"})
    return None
