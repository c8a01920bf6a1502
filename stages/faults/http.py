"""The HTTP side of the fault points: ``http.crash`` (``CrashMiddleware``), ``stream.slow_token``
(``slowed``, around a server's ``Generate``) and ``/debug/faults``, where tests arm them by name
(``add_fault_routes``; without ``--debug-faults`` these paths are 404 like any unknown path)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from contract.paths import CHAT_PATH, ENCODE_PATH
from stages.api.completion_schema import AnyRequest
from stages.api.errors import bad_request
from stages.api.lifetime import Generate
from stages.engine.outputs import RequestOutput
from stages.engine.multimodal import Prompt
from stages.engine.sampling_params import SamplingParams
from stages.faults.points import POINTS, Fault, Faults

CRASH_PATHS = (CHAT_PATH, ENCODE_PATH)


class CrashMiddleware:
    """ASGI middleware, fault point ``http.crash``: on a POST to one of ``CRASH_PATHS``, the route's
    read of the last piece of its body raises RuntimeError instead, so the route fails as it would on
    any unexpected exception once its body is in (the server has read the whole body)."""

    def __init__(self, app: ASGIApp, faults: Faults) -> None:
        self.app, self.faults = app, faults

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in CRASH_PATHS:
            await self.app(scope, receive, send)
            return

        async def crashing() -> Message:
            message = await receive()
            last = message["type"] == "http.request" and not message.get("more_body", False)
            if last and self.faults.take("http.crash"):
                raise RuntimeError("fault point http.crash")
            return message

        await self.app(scope, crashing, send)


def slowed(generate: Generate, faults: Faults) -> Generate:
    """``generate`` with fault point ``stream.slow_token``: each output of a stream held first."""

    async def slow(request_id: str, prompt: Prompt, params: SamplingParams,
                   body: AnyRequest) -> AsyncGenerator[RequestOutput, None]:
        outputs = await generate(request_id, prompt, params, body)
        return _held(outputs, faults) if body.stream else outputs

    return slow


async def _held(outputs: AsyncGenerator[RequestOutput, None], faults: Faults) -> AsyncGenerator[RequestOutput, None]:
    try:
        async for output in outputs:
            if (slow := faults.take("stream.slow_token")) is not None:
                await asyncio.sleep(slow.delay_s)
            yield output
    finally:
        await outputs.aclose()


class FaultBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    point: str
    times: int = Field(1, ge=1, le=1_000_000)
    delay_s: float = Field(0.0, ge=0.0, le=600.0)


def add_fault_routes(app: FastAPI, faults: Faults) -> None:
    @app.get("/debug/faults", include_in_schema=False)
    async def list_faults() -> dict:
        return {"points": POINTS, "armed": faults.armed()}

    @app.post("/debug/faults", include_in_schema=False)
    async def arm_fault(body: FaultBody) -> dict:
        try:
            faults.arm(Fault(body.point, body.times, body.delay_s))
        except ValueError as exc:
            raise bad_request(str(exc), "point", "unknown_fault_point") from None
        return {"armed": faults.armed()}
