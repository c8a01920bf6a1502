"""The drain gate (stages/api/drain_gate.py) over a bare ASGI app: every work route (chat, completions,
encode) is refused with 503 ``draining`` once the stage drains, and counted in flight before; the
rest is served. No model, no sockets."""

from __future__ import annotations

import json

import pytest

from contract.paths import ABORT_PATH, CHAT_PATH, COMPLETIONS_PATH, ENCODE_PATH, SERVER_INFO_PATH
from stages.api.drain_gate import DrainGate
from stages.drain import Drain

pytestmark = pytest.mark.unit


async def answer(gate: DrainGate, method: str, path: str) -> tuple[int, dict]:
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    await gate({"type": "http", "method": method, "path": path, "headers": []}, receive, send)
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return sent[0]["status"], json.loads(body)


async def ok(scope, receive, send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": b"{}"})


@pytest.mark.parametrize("path", [CHAT_PATH, COMPLETIONS_PATH, ENCODE_PATH])
async def test_every_work_route_is_counted_then_refused_while_draining(path):
    drain = Drain(1.0)
    seen: list[int] = []

    async def counted(scope, receive, send) -> None:
        seen.append(drain.in_flight)  # the drain waits for it
        await ok(scope, receive, send)

    gate = DrainGate(counted, drain, "colocated")
    assert await answer(gate, "POST", path) == (200, {}) and seen == [1] and drain.in_flight == 0
    drain.begin()
    status, body = await answer(gate, "POST", path)
    assert (status, body["error"]["code"], body["error"]["stage"]) == (503, "draining", "colocated")


@pytest.mark.parametrize("method, path", [("POST", ABORT_PATH), ("GET", SERVER_INFO_PATH)])
async def test_the_rest_is_served_while_draining(method, path):
    drain = Drain(1.0)
    drain.begin()
    assert await answer(DrainGate(ok, drain), method, path) == (200, {})
