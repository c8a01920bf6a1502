"""``POST /v1/completions`` (OpenAI's legacy completions API, text only) on every stage server that
serves chat: colocated, prefill and decode (``routes.create_app`` calls ``add_completion_route``).

It shares the chat route's lifetime rules: the same admission gate, the body cap, the server's
``generate`` (the engine whole, or a prefill's or decode's room coordinator, which read the body's
bootstrap fields as for chat), the engine's liveness watch, keep-alive comments in a quiet stream,
and the request aborted in the engine whenever its answer ends early. Prefill and decode servers
take one prompt per request (a request is one bootstrap room).

Each prompt is its own engine request (``n`` sequences); choice ``index`` = prompt index * n + the
sequence's index. A prefill's answer is its first token per choice, finish_reason ``length``.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from contract.errors import Code
from contract.paths import COMPLETIONS_PATH
from stages.api import openapi
from stages.api.completion_openapi import COMPLETIONS_ROUTE
from stages.api.admission import Admission
from stages.api.app_config import AppConfig, AppParts
from stages.api.body import read_body
from stages.api.completion_bodies import TokenText, chunk, choice, completion, joined, legacy_logprobs
from stages.api.completion_prompts import Prepared, prepare_completion
from stages.api.completion_schema import CompletionRequest, parse_completion_request
from stages.api.errors import APIError, Stage, bad_request, engine_unavailable, stamped
from stages.api.lifetime import (DONE, KEEPALIVE, Generate, admitted, event_stream, guarded, sse_event, ticking,
                                 unless_disconnected)
from stages.api.chat_response import usage
from stages.engine.async_engine import EngineUnavailable
from stages.engine.outputs import RequestOutput
from stages.engine.request import FinishReason
from stages.metrics import RequestTimer
from stages.text_bound import TextBound




def add_completion_route(app: FastAPI, parts: AppParts, config: AppConfig, generate: Generate, gate: Admission,
                         bound: TextBound | None) -> None:
    """Add the route to ``app`` (``create_app``'s own parts, config, generate, gate and bound);
    ``parts.tokenizer`` reads text prompts and names the tokens in logprobs."""
    engine, metrics, model_name, token_text = parts.engine, parts.metrics, config.model_name, parts.token_text()
    openapi.install(app, (CompletionRequest,))

    @app.post(COMPLETIONS_PATH, **COMPLETIONS_ROUTE)
    async def completions(request: Request) -> Response:
        return await admitted(gate, _complete(request))

    async def _complete(request: Request) -> Response:
        timer = metrics.timer()
        body = await run_in_threadpool(parse_completion_request, await read_body(request, config.max_body_bytes), bound)
        if body.model is not None and body.model != model_name:
            raise APIError(404, f"The model `{body.model}` does not exist; this server serves `{model_name}`.",
                           param="model", code=Code.MODEL_NOT_FOUND)
        if len(body.prompts) > 1 and body.bootstrap_room is not None:
            raise bad_request("A prefill or decode server takes one prompt per request (one bootstrap room); "
                              f"this request has {len(body.prompts)}.", "prompt", Code.INVALID_VALUE)
        if not engine.alive:
            raise engine_unavailable()
        prepared = await run_in_threadpool(prepare_completion, body, parts.tokenizer, engine,
                                           config.generation_defaults)
        run = _Run(f"cmpl-{uuid.uuid4().hex}", int(time.time()), model_name, timer, body, prepared,
                   token_text)
        streams: list[AsyncGenerator[RequestOutput, None]] = []
        try:
            for i, prompt in enumerate(prepared.prompts):
                request_id = run.id if len(prepared.prompts) == 1 else f"{run.id}-{i}"
                streams.append(guarded(engine, await generate(request_id, prompt, prepared.params, body)))
        except BaseException as exc:
            for stream in streams:
                await stream.aclose()
            if isinstance(exc, ValueError):  # already checked by prepare_completion(); the engine checks again
                raise bad_request(str(exc), None, "invalid_request") from None
            if isinstance(exc, EngineUnavailable):
                raise engine_unavailable() from None
            raise
        outputs = _merged(streams)
        if body.stream:
            return event_stream(_sse(run, ticking(outputs, config.stream_keepalive_s), config.stage))
        return await unless_disconnected(request, _whole(run, outputs))


@dataclass
class _Choice:
    """What one choice has produced so far."""

    pieces: list[str] = field(default_factory=list)
    logprobs: list[dict] = field(default_factory=list)
    offset: int = 0  # characters of the choice's text so far (for text_offset)
    last: RequestOutput | None = None
    echoed: bool = False


@dataclass
class _Run:
    id: str
    created: int
    model: str
    timer: RequestTimer
    body: CompletionRequest
    prepared: Prepared
    token_text: TokenText
    choices: dict[int, _Choice] = field(default_factory=dict)
    prompt_logprobs: dict[int, list] = field(default_factory=dict)  # prompt index -> the engine's prompt logprobs
    cached: dict[int, int] = field(default_factory=dict)  # prompt index -> cached prompt tokens

    def take(self, prompt_index: int, output: RequestOutput) -> dict:
        """Record ``output`` (of prompt ``prompt_index``); the chunk choice it makes (echo included the
        first time the choice appears)."""
        n = self.prepared.params.n
        index = prompt_index * n + output.index
        state = self.choices.setdefault(index, _Choice())
        if output.prompt_logprobs is not None:
            self.prompt_logprobs[prompt_index] = output.prompt_logprobs
        self.cached[prompt_index] = output.cached_tokens
        k = self.body.logprobs
        text, parts = "", []
        if self.body.echo and not state.echoed:
            state.echoed = True
            text = self.prepared.texts[prompt_index]
            if k is not None:
                ids = self.prepared.prompts[prompt_index].token_ids
                entries = self.prompt_logprobs.get(prompt_index) or [None] * len(ids)
                parts.append(legacy_logprobs(entries, ids, self.token_text, k, state.offset))
                state.offset += sum(len(t) for t in parts[-1]["tokens"])
        text += output.text
        if k is not None and output.token_ids:
            entries = output.logprobs or [None] * len(output.token_ids)
            parts.append(legacy_logprobs(entries, output.token_ids, self.token_text, k, state.offset))
            state.offset += sum(len(t) for t in parts[-1]["tokens"])
        state.pieces.append(text)
        state.logprobs += parts
        state.last = output
        self.timer.tokens(self.completion_tokens)
        reason = output.finish_reason.value if output.finish_reason is not None else None
        return choice(index, text, joined(parts) if parts else None, reason)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(prompt.token_ids) for prompt in self.prepared.prompts)

    @property
    def completion_tokens(self) -> int:
        return sum(state.last.completion_tokens for state in self.choices.values() if state.last is not None)

    def usage(self) -> dict:
        return usage(self.prompt_tokens, self.completion_tokens, sum(self.cached.values()))

    def failure(self) -> APIError | None:
        """The engine's error if a choice failed or was aborted, else None."""
        for state in self.choices.values():
            last = state.last
            if last is not None and (last.error is not None or last.finish_reason is FinishReason.ABORT):
                return APIError(500, f"The engine failed on this request: {last.error or 'it was aborted'}",
                                code=Code.ENGINE_ERROR)
        return None

    def record(self, finished: bool) -> None:
        """Count the request once: ``error`` if a choice failed, ``abort`` if it ended early, else how
        its last choice finished."""
        lasts = [state.last for state in self.choices.values() if state.last is not None]
        reason = "error" if any(o.error is not None for o in lasts) else "abort" if not finished or not lasts else \
            next((o.finish_reason.value for o in reversed(lasts) if o.finish_reason is not None), "abort")
        self.timer.finish(reason, self.prompt_tokens, self.completion_tokens)

    def expected_choices(self) -> int:
        return len(self.prepared.prompts) * self.prepared.params.n


async def _whole(run: _Run, outputs: AsyncGenerator[tuple[int, RequestOutput], None]) -> JSONResponse:
    finished = False
    try:
        async for prompt_index, output in outputs:
            run.take(prompt_index, output)
            if (error := run.failure()) is not None:
                raise error
        finished = True
    finally:
        await outputs.aclose()
        run.record(finished)
    unfinished = [s for s in run.choices.values() if s.last is None or s.last.finish_reason is None]
    if len(run.choices) != run.expected_choices() or unfinished:
        raise APIError(500, "The engine failed on this request: it ended without finishing every choice",
                       code=Code.ENGINE_ERROR)
    choices = [choice(index, "".join(state.pieces), joined(state.logprobs) if run.body.logprobs is not None else None,
                      state.last.finish_reason.value if state.last and state.last.finish_reason else None)
               for index, state in run.choices.items()]
    return JSONResponse(completion(run.id, run.created, run.model, choices, run.usage()))


async def _sse(run: _Run, outputs: AsyncGenerator[tuple[int, RequestOutput] | None, None],
               stage: Stage) -> AsyncIterator[str]:
    """A chunk per output that says something (text, logprobs or a finish), the usage chunk if asked
    for, an in-band error if the engine failed, then ``[DONE]``; ``: keep-alive`` while quiet."""
    finished = False
    try:
        async for item in outputs:
            if item is None:
                yield KEEPALIVE
                continue
            piece = run.take(*item)
            if (error := run.failure()) is not None:
                raise error
            if piece["text"] or piece["logprobs"] or piece["finish_reason"]:
                yield sse_event(chunk(run.id, run.created, run.model, [piece]))
        finished = True
        if run.body.include_usage:
            yield sse_event(chunk(run.id, run.created, run.model, [], usage_body=run.usage()))
    except APIError as exc:
        yield sse_event(stamped(exc, stage).body())
    finally:
        await outputs.aclose()
        run.record(finished)
    yield DONE


async def _merged(streams: list[AsyncGenerator[RequestOutput, None]]) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """The outputs of every prompt's stream as they come, each with its prompt's index. Closing this
    closes (aborts) every stream."""
    pending: dict[asyncio.Future, int] = {}
    try:
        pending = {asyncio.ensure_future(anext(stream)): i for i, stream in enumerate(streams)}
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for step in sorted(done, key=pending.__getitem__):
                i = pending.pop(step)
                if isinstance(step.exception(), StopAsyncIteration):
                    continue
                output = step.result()
                pending[asyncio.ensure_future(anext(streams[i]))] = i
                yield i, output
    finally:
        for step in pending:
            step.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for stream in streams:
            await stream.aclose()
