"""OpenAI-style errors: one exception type for the API layer and the FastAPI handlers that turn
every non-2xx response (ours, FastAPI's 404/405, pydantic's validation errors, crashes) into

    {"error": {"message": ..., "type": ..., "param": ..., "code": ...}}

plus, inside ``error``, the typed fields (``ErrorFields``) an error between our servers carries
where it knows them: ``stage`` (the role that answers: prefill, decode, encoder), ``room`` (the
bootstrap room), ``image_key`` (the image the error is about) and ``peer_code`` (a decode reporting
its prefill's failure, ``peer_failed``: the prefill's own code). The router reads these, never the
message (``router/dispatch/verdict.py``; docs/protocol.md "Typed error fields").

An unexpected exception is answered by ``CatchAll``, a middleware inside Starlette's
``ServerErrorMiddleware``: that one re-raises after its handler answers, and uvicorn then closes the
kept-alive connection without ``Connection: close`` (a pooled client's next request dies with
ECONNRESET). ``CatchAll`` answers the 500 and returns, so the connection stays usable. Only an
exception after the response has started (a stream) still ends the connection: nothing else can.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic_core import ErrorDetails
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from contract.errors import TYPED_FIELDS, Code

log = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 405: "invalid_request_error",
          413: "invalid_request_error", 500: "server_error", 503: "server_error"}
_FIELD = re.compile(r"^[a-z_][a-z0-9_]*$")
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}  # pydantic's union member tags
_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: Code.REQUEST_TOO_LARGE}  # the framework's own
_MISMATCH = re.compile(r".*_type|none_required")  # a union member of another type: the least useful error


# a server's role for the ``stage`` field: fixed, or read at each error (``stage serve pd``: none until
# the router assigns one)
Stage = str | Callable[[], str | None] | None


@dataclass(frozen=True)
class ErrorFields:
    """The typed fields of an error body (``TYPED_FIELDS``, in that order after the OpenAI four), each
    absent when None."""

    stage: str | None = None
    room: int | None = None
    image_key: str | None = None
    peer_code: str | None = None

    def body(self) -> dict:
        return {name: value for name in TYPED_FIELDS if (value := getattr(self, name)) is not None}


class APIError(Exception):
    """Raised anywhere under a route; becomes an OpenAI-style error response: ``type`` follows from
    ``status``, ``fields`` are the typed fields it knows."""

    def __init__(self, status: int, message: str, *, code: str, param: str | None = None,
                 headers: dict[str, str] | None = None, fields: ErrorFields = ErrorFields()) -> None:
        super().__init__(message)
        self.status = status
        self.headers = headers
        self.message = message
        self.param = param
        self.code = code
        self.type = _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
        self.fields = fields

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code,
                          **self.fields.body()}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None, code: str) -> APIError:
    return APIError(400, message, param=param, code=code)


def too_large(message: str, param: str | None, code: str) -> APIError:
    return APIError(413, message, param=param, code=code)


def engine_unavailable() -> APIError:
    return APIError(503, "The engine is not running; this server cannot take requests.", code=Code.ENGINE_UNAVAILABLE)


def overloaded(limit: int, retry_after_s: int = 1) -> APIError:
    return APIError(503, f"The server is at its limit of {limit} requests in flight (--max-num-seqs + --max-waiting); "
                    f"retry after {retry_after_s} s.", code=Code.SERVER_OVERLOADED,
                    headers={"Retry-After": str(retry_after_s)})


def unhealthy(failures: dict[str, str]) -> APIError:
    names = "; ".join(f"{name}: {reason}" for name, reason in sorted(failures.items()))
    return APIError(503, f"This server is unhealthy and should be restarted: {names}", code=Code.UNHEALTHY)


def param_name(loc: tuple) -> str | None:
    """('body', 'messages', 0, 'content', 'list[...]', 1, 'image_url') -> 'messages[0].content[1].image_url'."""
    name = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, int):
            name += f"[{part}]"
        elif _FIELD.match(part) and part not in _TYPE_TAGS:
            name += f".{part}" if name else part
    return name or None


def validation_error(errors: Sequence[ErrorDetails]) -> APIError:
    """The most specific of pydantic's errors: a union reports one per member, and the useful one is the
    deepest, and at equal depth the one from the member whose type matched."""
    if not errors:
        return bad_request("Invalid request body.", None, Code.INVALID_VALUE)
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return bad_request(f"The request body is not valid JSON: {detail}".rstrip(": "), param=None, code=Code.INVALID_JSON)
    error = max(errors, key=lambda e: (len(e.get("loc", ())), not _MISMATCH.fullmatch(e.get("type", ""))))
    param = param_name(tuple(error.get("loc", ())))
    message = str(error.get("msg", "invalid value")).removeprefix("Value error, ")
    if error.get("type") == "missing" and param:
        return bad_request(f"Missing required parameter: '{param}'.", param=param, code="missing_required_parameter")
    where = f"Invalid value for '{param}': " if param else "Invalid request body: "
    return bad_request(where + message, param=param, code=Code.INVALID_VALUE)


def stamped(error: APIError, stage: Stage) -> APIError:
    """``error`` with ``stage`` (the role now, if a callable) as its ``stage`` field, unless it names
    one already."""
    if error.fields.stage is None:
        error.fields = replace(error.fields, stage=stage() if callable(stage) else stage)
    return error


def install_error_handlers(app: FastAPI, stage: Stage = None) -> None:
    """Every error answer of ``app`` as an OpenAI body; ``stage``: the server's role, in each body's
    ``stage`` field (``stamped``)."""
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return stamped(exc, stage).response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return stamped(validation_error(list(exc.errors())), stage).response()

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> JSONResponse:
        code = _HTTP_CODES.get(exc.status_code, "invalid_request" if exc.status_code < 500 else "server_error")
        error = stamped(APIError(exc.status_code, str(exc.detail), code=code), stage)
        return JSONResponse(error.body(), status_code=exc.status_code, headers=getattr(exc, "headers", None))

    app.add_middleware(CatchAll, stage=stage)


class CatchAll:
    """ASGI middleware: an exception no handler took becomes a 500 OpenAI body, and the connection
    stays open for the client's next request. Re-raised only once the response has started."""

    def __init__(self, app: ASGIApp, stage: Stage = None) -> None:
        self.app = app
        self.stage = stage

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as exc:
            if started:
                raise
            log.exception("unhandled error on %s %s", scope.get("method"), scope.get("path"))
            crash = stamped(APIError(500, f"Internal server error: {type(exc).__name__}", code=Code.INTERNAL_ERROR),
                            self.stage)
            await crash.response()(scope, receive, send)
