"""The HTTP side of the fault points, in process: ``/debug/faults`` arms by name, ``http.crash`` fails
the next chat or encode request once its body is read (an unexpected exception: 500, the route's own
cleanup runs), ``stream.slow_token`` holds each output of a stream only; a server without
``--debug-faults`` plugs in nothing at any seam."""

from __future__ import annotations

import time

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from stages.api.errors import install_error_handlers
from stages.api.schemas import ChatCompletionRequest
from stages.disagg.hooks import DecodeHooks, PrefillHooks
from stages.encoder.worker import EncoderHooks
from stages.engine.multimodal import Prompt
from stages.engine.sampling_params import SamplingParams
from stages.faults.points import Fault, Faults
from stages.faults.http import slowed
from stages.faults.seams import FaultSeams, Seams, seams_for
from tests.support.transfer_fakes import FakeBackend

pytestmark = pytest.mark.unit


def crash_app() -> tuple[TestClient, FaultSeams, list[str]]:
    """An app with a chat and an encode route that read their body, and what each route saw."""
    app, seen = FastAPI(), []
    install_error_handlers(app, "colocated")
    for path in ("/v1/chat/completions", "/v1/encode", "/v1/other"):
        @app.post(path)
        async def route(request: Request) -> dict:
            try:
                body = await request.body()
            finally:
                seen.append(request.url.path)  # the route's own cleanup runs either way
            return {"bytes": len(body)}
    seams = FaultSeams()
    seams.install(app)
    return TestClient(app, raise_server_exceptions=False), seams, seen


def test_armed_by_name_and_crashing_the_next_chat_or_encode_request_once():
    client, seams, seen = crash_app()
    assert client.post("/debug/faults", json={"point": "http.crash", "times": 2}).json() == {
        "armed": [{"point": "http.crash", "times": 2, "delay_s": 0.0}]}
    assert client.post("/v1/other", json={"a": 1}).status_code == 200  # not a chat or encode route
    for path in ("/v1/chat/completions", "/v1/encode"):
        crashed = client.post(path, json={"a": 1})
        assert crashed.status_code == 500 and crashed.json()["error"]["code"] == "internal_error"
    assert seen == ["/v1/other", "/v1/chat/completions", "/v1/encode"]
    assert client.post("/v1/chat/completions", json={"a": 1}).json() == {"bytes": 7}
    listed = client.get("/debug/faults").json()
    assert listed["armed"] == [] and "http.crash" in listed["points"]
    unknown = client.post("/debug/faults", json={"point": "http.nope"})
    assert unknown.status_code == 400 and unknown.json()["error"]["code"] == "unknown_fault_point"


async def test_a_slow_token_holds_each_output_of_a_stream_and_nothing_else():
    faults = Faults()

    async def generate(request_id, prompt, params, body):
        async def outputs():
            for i in range(3):
                yield i
        return outputs()

    slow = slowed(generate, faults)
    args = ("r", Prompt(token_ids=[1]), SamplingParams())
    faults.arm(Fault("stream.slow_token", times=2, delay_s=0.2))
    whole = await slow(*args, ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}]}))
    assert [o async for o in whole] == [0, 1, 2] and faults.armed()[0]["times"] == 2
    started = time.monotonic()
    stream = await slow(*args, ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "x"}], "stream": True}))
    assert [o async for o in stream] == [0, 1, 2] and faults.armed() == []
    assert 0.4 <= time.monotonic() - started < 2.0


def test_without_debug_faults_no_seam_gets_anything():
    seams = seams_for(False)
    assert type(seams) is Seams and isinstance(seams_for(True), FaultSeams)
    assert seams.before_step() is None
    assert (type(seams.prefill()), type(seams.decode()), type(seams.encoder())) == (PrefillHooks, DecodeHooks,
                                                                                   EncoderHooks)
    backend = FakeBackend()

    async def generate(request_id, prompt, params, body):
        raise AssertionError("not called")

    assert seams.backend(backend) is backend and seams.generate(generate) is generate
    app = FastAPI()
    routes, middleware = list(app.routes), list(app.user_middleware)
    seams.install(app)
    assert (app.routes, app.user_middleware) == (routes, middleware)
    assert TestClient(app).get("/debug/faults").status_code == 404
