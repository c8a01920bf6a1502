"""The OpenAI-compatible HTTP layer over an ``AsyncEngine``: ``/v1/chat/completions`` (stream and
non-stream), ``/v1/models``, ``/health`` and ``/metrics``.

Body parsing lives in ``parse``, request conversion in ``chat``, the request's wire shape in ``schemas``,
the answer's in ``chat_response`` (built from the engine's outputs by ``chat_choices``), errors in
``errors``, what ``/openapi.json`` says of each route in ``openapi``, a request's lifetime (admission,
liveness, keep-alives, the abort of a request whose response ends early) in ``lifetime``. This module
wires them to routes; ``/v1/completions`` is added by ``completions``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.concurrency import run_in_threadpool

from contract.errors import Code
from contract.paths import CHAT_PATH, HEALTH_PATH, METRICS_PATH, MODELS_PATH
from stages.api import openapi
from stages.api.admission import Admission
from stages.api.app_config import AppConfig, AppParts
from stages.api.body import ReleaseMemory, read_body
from stages.api.completions import add_completion_route
from stages.api.chat_choices import Choices
from stages.api.chat_response import chunk, completion, usage
from stages.api.errors import (APIError, Stage, bad_request, engine_unavailable, install_error_handlers,
                               stamped, unhealthy)
from stages.api.lifetime import (DONE, KEEPALIVE, admitted, event_stream, guarded, run_whole, sse_event, ticking,
                                 unless_disconnected)
from stages.api.parse import parse_request
from stages.api.common_schemas import model_card
from stages.api.schemas import ChatCompletionRequest
from stages.api.tool_output import ToolOutput
from stages.api.tools import tool_output
from stages.engine.async_engine import EngineUnavailable
from stages.engine.outputs import RequestOutput
from stages.engine.request import FinishReason
from stages.metrics import RequestTimer
from stages.text_bound import TextBound

def create_app(parts: AppParts, config: AppConfig) -> FastAPI:
    """An app serving ``parts.engine`` as ``config`` says (``stages.api.app_config``). The caller starts
    and stops the engine, or passes a ``lifespan`` that does. ``generate`` is awaited before the
    response starts: it raises APIError, so that a stream and a non-stream request get the same
    status and body, and returns the request's outputs, which hold nothing until first iterated (they
    may be dropped unstarted).

    Admission: at most ``max_in_flight`` chat requests are held at once (from arrival until their
    response ends); beyond that a request gets 503 with ``Retry-After`` before its body is read.
    ``/health`` is 503 while the engine thread or any task of ``supervisor`` is dead. A stream that
    has sent nothing for ``stream_keepalive_s`` (waiting for the KV, a slow step) sends ``KEEPALIVE``,
    and again each ``stream_keepalive_s`` of silence after it."""
    engine, prepare, metrics, supervisor = parts.engine, parts.prepare, parts.metrics, parts.supervisor
    model_name, stage, token_text = config.model_name, config.stage, parts.token_text()
    supervisor.watch_thread("engine thread", lambda: engine.alive)
    gate = Admission(config.max_in_flight)
    bound = TextBound(engine.max_model_len, config.chars_per_token) if config.chars_per_token else None
    created = int(time.time())

    generate = parts.generate or run_whole(engine)
    app = FastAPI(title="epd-stage", version="0.1.0", lifespan=parts.lifespan)
    install_error_handlers(app, stage)
    app.add_middleware(ReleaseMemory)
    openapi.install(app)

    @app.get(HEALTH_PATH, **openapi.HEALTH_ROUTE)
    async def health() -> dict:
        failures = supervisor.failures()
        if failures:
            raise unhealthy(failures)
        return {"status": "ok"}

    @app.get(MODELS_PATH, **openapi.MODELS_ROUTE)
    async def models() -> dict:
        return {"object": "list", "data": [model_card(model_name, created, config.owned_by)]}

    @app.get(METRICS_PATH, **openapi.METRICS_ROUTE)
    async def prometheus() -> Response:
        metrics.refresh(engine.stats())
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post(CHAT_PATH, **openapi.CHAT_ROUTE)
    async def chat_completions(request: Request) -> Response:
        return await admitted(gate, _chat(request))

    async def _chat(request: Request) -> Response:
        timer = metrics.timer()  # from arrival: TTFT includes image decoding and preprocessing
        body = await run_in_threadpool(parse_request, await read_body(request, config.max_body_bytes), bound)
        if body.model is not None and body.model != model_name:
            raise APIError(404, f"The model `{body.model}` does not exist; this server serves `{model_name}`.",
                           param="model", code=Code.MODEL_NOT_FOUND)
        if not engine.alive:
            raise engine_unavailable()
        prompt, params = await run_in_threadpool(prepare, body)
        call = _Call(f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), model_name, timer)
        choices = Choices(params.n, logprobs=params.logprobs is not None, token_text=token_text,
                          tools=_tool_output(body), stream=bool(body.stream))
        try:
            outputs = guarded(engine, await generate(call.id, prompt, params, body))
        except ValueError as exc:  # already checked by prepare(); the engine checks again
            raise bad_request(str(exc), None, "invalid_request") from None
        except EngineUnavailable:  # the engine thread ended after the check above
            raise engine_unavailable() from None
        if body.stream:
            events = _sse(call, choices, ticking(outputs, config.stream_keepalive_s), body.include_usage, stage)
            return event_stream(events)
        return await unless_disconnected(request, _complete(call, choices, outputs))

    add_completion_route(app, parts, config, generate, gate, bound)  # stages.api.completions
    return app


@dataclass
class _Call:
    id: str
    created: int
    model: str
    timer: RequestTimer

    def record(self, last: RequestOutput | None, choices: Choices) -> None:
        """Count the request once: how it finished (its last output's reason), ``error``, or ``abort``
        if it ended before every sequence finished; its completion tokens summed over its sequences."""
        if last is None:
            reason = "abort"
        elif last.error is not None:
            reason = "error"
        else:
            reason = last.finish_reason.value if choices.finished and last.finish_reason is not None else "abort"
        self.timer.finish(reason, choices.prompt_tokens, choices.completion_tokens, choices.longest)


def _tool_output(body: ChatCompletionRequest) -> ToolOutput | None:
    """How the request's output becomes tool calls (``stages.api.tools``); None without tools to call."""
    return tool_output(body.offered_tools, body.tool_choice_json)


def _failed(output: RequestOutput) -> bool:
    return output.error is not None or output.finish_reason is FinishReason.ABORT


def _engine_error(output: RequestOutput | None) -> APIError:
    reason = (output.error if output else None) or "the request was aborted"
    return APIError(500, f"The engine failed on this request: {reason}", code=Code.ENGINE_ERROR)


async def _complete(call: _Call, choices: Choices, outputs: AsyncGenerator[RequestOutput, None]) -> JSONResponse:
    last: RequestOutput | None = None
    failed: RequestOutput | None = None
    try:
        async for last in outputs:
            call.timer.tokens(last.completion_tokens)
            if _failed(last):
                failed = failed or last
            else:
                choices.add(last)
    finally:
        call.record(failed or last, choices)
    if failed is not None or not choices.finished:
        raise _engine_error(failed or last)
    return JSONResponse(completion(call.id, call.created, call.model, choices.choices(),
                                   usage(choices.prompt_tokens, choices.completion_tokens, choices.cached_tokens)))


async def _sse(call: _Call, choices: Choices, outputs: AsyncGenerator[RequestOutput | None, None],
               include_usage: bool, stage: Stage) -> AsyncIterator[str]:
    """The events of one stream: a role chunk per choice, the chunks of each output (``Choices.pieces``:
    its text or tool-call deltas, its logprobs, its choice's finish chunk), the usage chunk if asked
    for, an in-band error if the engine failed, then ``[DONE]``. ``outputs`` yields None when it has
    been silent for the keep-alive interval (``ticking``): ``KEEPALIVE``.

    The role chunks leave with the first output, not before: a stream's first event is its first
    token (in PD, the decode's first event means the KV has arrived), and a failure before it is an
    error event alone, which the router may retry elsewhere (its commit point, ``router.dispatch.attempt``)."""
    def piece(choice: dict | None, usage_body: dict | None = None) -> str:
        return sse_event(chunk(call.id, call.created, call.model, None if choice is None else [choice],
                           with_usage=include_usage, usage_body=usage_body))

    last: RequestOutput | None = None
    try:
        async for output in outputs:
            if output is None:
                yield KEEPALIVE
                continue
            first, last = last is None, output
            call.timer.tokens(last.completion_tokens)
            if _failed(last):
                raise _engine_error(last)
            for choice in [*choices.roles(), *choices.pieces(last)] if first else choices.pieces(last):
                yield piece(choice)
        if not choices.finished:  # the outputs ended early: not the engine's way
            raise _engine_error(None)
        if include_usage:
            yield piece(None, usage_body=usage(choices.prompt_tokens, choices.completion_tokens, choices.cached_tokens))
    except APIError as exc:  # the engine failed or died: tell the client in-band, then end the stream
        yield sse_event(stamped(exc, stage).body())
    finally:
        await outputs.aclose()
        call.record(last, choices)
    yield DONE
