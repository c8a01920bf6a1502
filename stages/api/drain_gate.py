"""The HTTP side of a stage's drain (``stages.drain``): an ASGI middleware every role's app runs
behind (``stages.server`` adds it), outermost of ours.

While the server drains:
- ``GET /health`` answers 503 ``{"status": "draining"}`` (the router takes the worker out of rotation
  at once, without charging its breaker; Kubernetes' readiness probe fails);
- a new work request (``WORK_PATHS``: chat, completions, encode) answers 503 with the OpenAI error code
  ``draining`` before anything of it is read (the router retries it on another worker);
- everything else (``/v1/abort``, ``/server_info``, ``/metrics``, the admin calls) is served as usual.

Work requests admitted before are counted in flight until their response has ended. Once the grace
has passed (``Drain.expired``), each one still running is cancelled (its cleanup aborts it in the
engine and frees its blocks, as a client leaving does) and ends with an error: a 503
``drain_timeout`` answer if its response had not started, else, on a stream, an in-band error event
and ``[DONE]`` (docs/protocol.md "Draining").
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from contract.errors import Code
from contract.paths import CHAT_PATH, COMPLETIONS_PATH, ENCODE_PATH, HEALTH_PATH
from stages.api.errors import APIError, ErrorFields
from stages.drain import Drain

WORK_PATHS = frozenset({CHAT_PATH, COMPLETIONS_PATH, ENCODE_PATH})
DRAINING_HEALTH = b'{"status":"draining"}'


def draining_error(stage: str | None) -> APIError:
    return APIError(503, "This server is shutting down and takes no new requests; send it to another worker.",
                    code=Code.DRAINING, fields=ErrorFields(stage=stage))


def drain_timeout_error(stage: str | None, grace_s: float) -> APIError:
    return APIError(503, f"This server is shutting down and the request was still running after {grace_s:g} s "
                         "(--shutdown-grace-s); it was aborted.", code=Code.DRAIN_TIMEOUT,
                    fields=ErrorFields(stage=stage))


@dataclass
class _Progress:
    """What of one response has gone out."""

    started: bool = False
    stream: bool = False  # text/event-stream
    ended: bool = False


class DrainGate:
    """ASGI middleware over one app; ``stage``: the role in the errors' ``stage`` field (None: none)."""

    def __init__(self, app: ASGIApp, drain: Drain, stage: str | None = None) -> None:
        self.app = app
        self.drain = drain
        self.stage = stage

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self._gated(scope):
            await self.app(scope, receive, send)
            return
        if self.drain.draining:
            if scope["path"] == HEALTH_PATH:
                await _send_json(send, 503, DRAINING_HEALTH)
            else:
                await _send_error(send, draining_error(self.stage))
            return
        self.drain.enter()
        try:
            await self._run(scope, receive, send)
        finally:
            self.drain.leave()

    def _gated(self, scope: Scope) -> bool:
        path = scope["path"]
        return (path == HEALTH_PATH and self.drain.draining) or (path in WORK_PATHS and scope["method"] == "POST")

    async def _run(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The app's answer, unless the drain expires first: then the app is cancelled and the
        client told (``_abort``)."""
        progress = _Progress()

        async def tracked(message: Message) -> None:
            if message["type"] == "http.response.start":
                progress.started = True
                headers = dict(message.get("headers", []))
                progress.stream = headers.get(b"content-type", b"").startswith(b"text/event-stream")
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                progress.ended = True
            await send(message)

        task = asyncio.ensure_future(self.app(scope, receive, tracked))
        try:
            await asyncio.wait({task, self.drain.expired()}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            task.cancel()
            await asyncio.wait({task})
            raise
        if task.done() or progress.ended:  # answered (or its last byte is out): as usual
            await task
            return
        task.cancel()
        await asyncio.wait({task})  # its cleanup runs: the request is aborted in the engine, its blocks freed
        if not task.cancelled():
            task.exception()  # marked as seen: the client is told below
        if not progress.ended:
            await self._abort(send, progress)

    async def _abort(self, send: Send, progress: _Progress) -> None:
        error = drain_timeout_error(self.stage, self.drain.grace_s)
        if not progress.started:
            await _send_error(send, error)
        elif progress.stream:
            event = json.dumps(error.body(), separators=(",", ":"))
            await send({"type": "http.response.body", "body": f"data: {event}\n\ndata: [DONE]\n\n".encode(),
                        "more_body": False})
        else:  # a JSON answer half sent: end it (the client sees a short body)
            await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _send_error(send: Send, error: APIError) -> None:
    await _send_json(send, error.status, json.dumps(error.body(), separators=(",", ":")).encode())


async def _send_json(send: Send, status: int, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body, "more_body": False})
