"""SIGTERM drains a stage (``stages.drain``, ``stages.api.drain_gate``) and the router takes it out of
rotation (docs/protocol.md "Draining"):

- two colocated workers behind a router (and a prefill with two decodes, one of them leaving), a bounded load of concurrent streaming and non-streaming
  requests (official client), SIGTERM to one worker while it holds some: every request gets the text
  it would have had (greedy, compared with the other worker's answers to the same bodies), the
  worker answers ``/health`` 503 ``{"status": "draining"}`` and a new chat 503 ``draining`` while it
  finishes its requests, exits 0 within its ``--shutdown-grace-s``, and the router has it out of
  rotation with its circuit closed (a drain is not a failure);
- a worker whose requests outlive its grace aborts them cleanly: a stream ends with an in-band
  ``drain_timeout`` error event and ``[DONE]``, a non-stream answer is a 503 ``drain_timeout``; the
  worker still exits 0;
- the router's own SIGTERM lets a stream in flight finish, then it exits 0;
- an encoder finishes the encode in flight and refuses a new one (503 ``draining``), then exits 0;
- the pure parts: the drain's states, and the router's verdict on a draining answer.
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable

import httpx
import openai
import pytest

from router.dispatch.verdict import from_answer, from_event
from stages.drain import Drain, DrainState
from process.ports import free_port
from tests.conftest import REPO
from tests.support.redis_fixtures import redis_server, redis_url  # noqa: F401
from tests.support.router_helpers import arm, metric, png

pytestmark = pytest.mark.timeout(300)
TOKEN = "a-token-of-twenty-chars"
GRACE_S = 20.0
WAIT_S = 30.0  # every bounded wait below
DRAINING = {"error": {"message": "This server is shutting down and takes no new requests; send it to another "
                                 "worker.", "type": "server_error", "param": None, "code": "draining",
                      "stage": "colocated"}}


# --- pure ------------------------------------------------------------------------------------
@pytest.mark.unit
async def test_the_drain_waits_for_work_in_flight_then_expires():
    drain = Drain(0.2)
    assert (drain.state, drain.draining) == (DrainState.SERVING, False)
    drain.enter()
    asyncio.get_running_loop().call_later(0.05, drain.leave)
    assert await drain.run() is True and drain.state is DrainState.DRAINING and not drain.expired().done()
    late = Drain(0.1)
    late.enter()
    expired = late.expired()
    expired.add_done_callback(lambda _: late.leave())  # the gate aborts the request: it leaves
    assert await late.run() is False and late.state is DrainState.EXPIRED and expired.done()
    with pytest.raises(RuntimeError, match="Drain.leave without a matching enter"):
        late.leave()
    with pytest.raises(ValueError, match=r"--shutdown-grace-s must be > 0, got 0"):
        Drain(0)


@pytest.mark.unit
def test_the_router_retries_a_draining_answer_without_blame():
    refused = from_answer("decode", "http://d", 503, json.dumps(DRAINING).encode())
    assert (refused.code, refused.leaving, refused.refused, refused.busy, refused.client_fault) == (
        "draining", True, True, False, False)
    aborted = from_event("decode", "http://d", {"error": {"message": "m", "code": "drain_timeout"}})
    assert (aborted.status, aborted.leaving, aborted.refused) == (503, True, False)
    other = from_answer("decode", "http://d", 503, b'{"error": {"message": "m", "code": "engine_unavailable"}}')
    assert (other.leaving, other.refused) == (False, False)


# --- real servers ----------------------------------------------------------------------------
def bodies(count: int) -> list[tuple[list[dict], bool]]:
    return [([{"role": "user", "content": f"Tell me about thing number {i}."}], i % 2 == 0) for i in range(count)]


async def answer(client: openai.AsyncOpenAI, model: str, msgs: list[dict], stream: bool, max_tokens: int = 16) -> str:
    kwargs = dict(model=model, messages=msgs, max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True})
    if not stream:
        return (await client.chat.completions.create(**kwargs)).choices[0].message.content
    return "".join([chunk.choices[0].delta.content or "" async for chunk in
                    await client.chat.completions.create(**kwargs, stream=True) if chunk.choices])


def workers_of(router_url: str) -> dict[str, dict]:
    listing = httpx.get(f"{router_url}/admin/workers", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
    assert listing.status_code == 200, listing.text
    return {w["url"]: w for w in listing.json()["workers"]}


def wait_until(what: str, check, within_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + within_s
    while not check():
        assert time.monotonic() < deadline, f"not within {within_s} s: {what}"
        time.sleep(0.05)


def health(url: str) -> tuple[int, dict]:
    response = httpx.get(f"{url}/health", timeout=5)
    return response.status_code, response.json()


@pytest.fixture
def model_path(tiny_model) -> str:
    return str(tiny_model("qwen2_vl"))


def engine_load(server) -> float:
    return metric(server.url, "epd_running_requests") + metric(server.url, "epd_queue_depth")


def all_placed(router, leaving, staying, count: int) -> Callable[[], bool]:
    """Every one of the first ``count`` requests is leased (or done), and the ``leaving`` worker holds
    two or more, each in its engine: none of them reaches it after the SIGTERM."""
    def placed() -> bool:
        workers = workers_of(router.url)
        held = workers[leaving.url]["outstanding"]
        done = metric(router.url, 'epd_router_requests_total{outcome="success"}')
        return held >= 2 and held + workers[staying.url]["outstanding"] + done == count and engine_load(leaving) == held
    return placed


def drain_under_load(router, watcher, leaving, placed: Callable[[], bool], expected_base: str, count: int = 12,
                     refused_before_checked: bool = True) -> None:
    """A first wave of ``count`` mixed requests through ``router``; once ``placed()``, SIGTERM to the
    ``leaving`` worker; a second wave while it drains. Every answer must be the greedy one (the same
    bodies sent to ``expected_base`` afterwards), the worker must exit 0 within its grace, both routers
    must have it out of rotation with its circuit closed, and ``router`` (its health loop asleep) must
    have retried a draining answer (``refused_before_checked``: and not have marked it before the second
    wave)."""
    first, second = bodies(count), bodies(count + 8)[count:]

    async def load() -> tuple[list[str], float]:
        client = openai.AsyncOpenAI(base_url=router.base_url, api_key="x", max_retries=0, timeout=120)
        model = (await client.models.list()).data[0].id
        wave = [asyncio.ensure_future(answer(client, model, m, s)) for m, s in first]
        await asyncio.to_thread(wait_until, "the first wave placed", placed)
        leaving.proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        await asyncio.to_thread(wait_until, "/health says draining",
                                lambda: health(leaving.url) == (503, {"status": "draining"}))
        refused = httpx.post(f"{leaving.url}/v1/chat/completions", json={"messages": first[0][0]}, timeout=10)
        role = workers_of(router.url)[leaving.url]["role"]
        assert (refused.status_code, refused.json()) == (503, {"error": {**DRAINING["error"], "stage": role}})
        await asyncio.to_thread(wait_until, "the watching router has it out of rotation",
                                lambda: not workers_of(watcher.url)[leaving.url]["healthy"])
        if refused_before_checked:
            assert workers_of(router.url)[leaving.url]["healthy"]  # the router under load has not checked yet
        late = [asyncio.ensure_future(answer(client, model, m, s)) for m, s in second]  # while it drains
        answers = await asyncio.wait_for(asyncio.gather(*wave, *late), 120)
        await client.close()
        return answers, sent

    answers, sent = asyncio.run(load())
    assert leaving.proc.wait(GRACE_S) == 0
    assert time.monotonic() - sent < GRACE_S
    assert "drained: every request in flight finished" in leaving.log()
    # the watcher only ever saw /health say draining: out of rotation, breaker untouched. The router under
    # load may, where refused_before_checked is False, have sent a request after the worker had drained and
    # exited: a refused connection is a real failure and may open its breaker (once it has learned of the
    # drain it sends none; it never learns before the exit when all the worker's requests were placed early)
    circuits = ("closed",) if refused_before_checked else ("closed", "open")
    seen = [(w[leaving.url]["healthy"], w[leaving.url]["circuit"]) for w in map(workers_of, (router.url, watcher.url))]
    assert seen[1] == (False, "closed") and seen[0][0] is False and seen[0][1] in circuits, seen
    role = workers_of(router.url)[leaving.url]["role"]
    assert metric(router.url, f'epd_router_retries_total{{stage="{role}"}}') >= 1  # a draining answer, retried
    marked = (f"{role} {leaving.url} is unhealthy: it is draining (shutting down): out of rotation, its breaker "
              "untouched")
    # a worker whose requests were all placed early may finish them and exit between two of the watcher's
    # checks (a prefill drained 4 rooms in 42 ms): then the watcher finds it gone, not draining
    gone = f"{role} {leaving.url} is unhealthy: ClientConnectorError"
    assert marked in watcher.log() or (not refused_before_checked and gone in watcher.log()), watcher.log()[-3000:]

    async def expected() -> list[str]:
        client = openai.AsyncOpenAI(base_url=expected_base, api_key="x", max_retries=0, timeout=120)
        model = (await client.models.list()).data[0].id
        texts = await asyncio.gather(*(answer(client, model, m, s) for m, s in first + second))
        await client.close()
        return texts

    assert metric(router.url, 'epd_router_requests_total{outcome="success"}') == len(first) + len(second)
    assert answers == asyncio.run(expected()) and all(answers)


# the router under load learns of the drain only from the draining answers (its health loop sleeps), which it
# must retry elsewhere without a breaker charge (one charge would open the circuit); a second router watches
# /health only
# each step of the leaving worker: its requests (16 tokens) drain for ~5 s after the SIGTERM, time for the
# checks before the second wave on a loaded machine (at 0.1 s, ~1.6 s: the worker had exited before a
# second-wave request reached it, a refused connection that opened the breaker, twice in one full run)
STALL_S = 0.3
UNDER_LOAD = ("--admin-token", TOKEN, "--health-interval-s", "60", "--breaker-failures", "1")
WATCHING = ("--admin-token", TOKEN, "--health-interval-s", "0.2")


def test_sigterm_under_load_loses_no_request(start_server, model_path):
    flags = ("--model", model_path, "--debug-faults", "--shutdown-grace-s", str(GRACE_S))
    leaving, staying = start_server("colocated", *flags), start_server("colocated", *flags)
    pair = ("--colocated", leaving.url, "--colocated", staying.url)
    router = start_server("router", *pair, *UNDER_LOAD, "--policy-colocated", "round_robin")
    watcher = start_server("router", *pair, *WATCHING)
    arm(leaving, "engine.stall", times=1000, delay_s=STALL_S)  # its requests stay in flight for seconds
    drain_under_load(router, watcher, leaving, all_placed(router, leaving, staying, 12), staying.base_url)


def test_a_decode_drains_under_pd_load(start_server, model_path):
    pd = ("--model", model_path, "--kv-cache-mib", "16", "--transfer", "mooncake")
    prefill = start_server("prefill", *pd, "--bootstrap-port", str(free_port()))
    leaving, staying = (start_server("decode", *pd, "--debug-faults", "--shutdown-grace-s", str(GRACE_S))
                        for _ in range(2))
    workers = ("--prefill", prefill.url, "--decode", leaving.url, "--decode", staying.url)
    router = start_server("router", *workers, *UNDER_LOAD, "--policy-decode", "round_robin")
    watcher = start_server("router", *workers, *WATCHING)
    arm(leaving, "engine.stall", times=1000, delay_s=STALL_S)
    drain_under_load(router, watcher, leaving, all_placed(router, leaving, staying, 8), router.base_url,
                     count=8)  # then: P and the other D


def test_a_prefill_drains_its_paired_rooms(start_server, model_path):
    """The leaving prefill's rooms, paired and held in its engine at SIGTERM, still prefill and write
    their KV (its bootstrap endpoint stays up until they end)."""
    pd = ("--model", model_path, "--kv-cache-mib", "16", "--transfer", "mooncake")
    leaving, staying = (start_server("prefill", *pd, "--bootstrap-port", str(free_port()), "--debug-faults",
                                     "--shutdown-grace-s", str(GRACE_S)) for _ in range(2))
    decode = start_server("decode", *pd)
    workers = ("--prefill", leaving.url, "--prefill", staying.url, "--decode", decode.url)
    router = start_server("router", *workers, *UNDER_LOAD, "--policy-prefill", "round_robin")
    watcher = start_server("router", *workers, *WATCHING)
    arm(leaving, "engine.stall", times=1000, delay_s=1.0)  # each prefill step waits 1 s
    # a prefill's lease ends before its request's answer: placed once it holds two; one that reaches it after
    # the SIGTERM is refused and retried (so the router under load may mark it before the second wave)
    drain_under_load(router, watcher, leaving, lambda: workers_of(router.url)[leaving.url]["outstanding"] >= 2,
                     router.base_url, count=8, refused_before_checked=False)
    held = re.search(r"draining: (\d+) request\(s\) in flight", leaving.log())
    assert held is not None and int(held[1]) >= 1, leaving.log()[-3000:]


def test_requests_that_outlive_the_grace_end_with_a_clean_error(start_server, model_path):
    server = start_server("colocated", "--model", model_path, "--debug-faults", "--shutdown-grace-s", "2")
    arm(server, "engine.stall", times=1000, delay_s=0.5)  # 64 tokens: some 30 s, far past the grace
    body = {"messages": [{"role": "user", "content": "Go on."}], "max_tokens": 64, "temperature": 0,
            "ignore_eos": True}

    async def run() -> tuple[list[str], httpx.Response, float]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            whole = asyncio.ensure_future(client.post("/v1/chat/completions", json=body))
            async with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as stream:
                lines = stream.aiter_lines()
                events = [await anext(lines)]  # the role chunk: the stream is in flight
                await asyncio.to_thread(wait_until, "both requests run",
                                        lambda: metric(server.url, "epd_running_requests") == 2)
                server.proc.send_signal(signal.SIGTERM)
                sent = time.monotonic()
                events += [line async for line in lines]
            return [e for e in events if e.startswith("data: ")], await whole, sent

    events, whole, sent = asyncio.run(run())
    message = ("This server is shutting down and the request was still running after 2 s (--shutdown-grace-s); "
               "it was aborted.")
    error = {"error": {"message": message, "type": "server_error", "param": None, "code": "drain_timeout",
                       "stage": "colocated"}}
    assert events[-1] == "data: [DONE]" and json.loads(events[-2].removeprefix("data: ")) == error
    assert len(events) < 64  # cut short, not finished
    assert (whole.status_code, whole.json()) == (503, error)
    assert server.proc.wait(WAIT_S) == 0
    assert time.monotonic() - sent < 2 + 5 + 3  # the grace, the aborted requests' ending (ABORT_WAIT_S), slack
    assert "2 request(s) still running after 2 s (--shutdown-grace-s): aborting them" in server.log()


def test_the_router_lets_a_stream_finish_on_sigterm(start_server, model_path):
    worker = start_server("colocated", "--model", model_path, "--debug-faults")
    router = start_server("router", "--colocated", worker.url, "--shutdown-grace-s", "20")
    arm(worker, "engine.stall", times=1000, delay_s=0.1)

    async def run() -> tuple[str, float]:
        client = openai.AsyncOpenAI(base_url=router.base_url, api_key="x", max_retries=0, timeout=60)
        model = (await client.models.list()).data[0].id
        stream = await client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi."}],
                                                      max_tokens=20, temperature=0, stream=True,
                                                      extra_body={"ignore_eos": True})
        text = ""
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content and not text:
                router.proc.send_signal(signal.SIGTERM)  # the first text is out: the stream is in flight
                sent = time.monotonic()
            text += (chunk.choices[0].delta.content or "") if chunk.choices else ""
        await client.close()
        return text, sent

    text, sent = asyncio.run(run())
    assert router.proc.wait(WAIT_S) == 0
    assert time.monotonic() - sent < 20
    direct = openai.OpenAI(base_url=worker.base_url, api_key="x", max_retries=0, timeout=60)
    reply = direct.chat.completions.create(model=direct.models.list().data[0].id, max_tokens=20, temperature=0,
                                           messages=[{"role": "user", "content": "Hi."}],
                                           extra_body={"ignore_eos": True})
    assert text == reply.choices[0].message.content != ""


def test_an_encoder_finishes_its_encode_and_refuses_new_ones(start_server, model_path, redis_url):
    encoder = start_server("encoder", "--model", model_path, "--redis-url", redis_url, "--debug-faults",
                           "--shutdown-grace-s", str(GRACE_S))
    arm(encoder, "encoder.stall", times=1, delay_s=2.0)  # the first batch waits 2 s before its vision-tower call
    image = {"data": base64.b64encode(png(40, 24, 5)).decode()}

    async def run() -> tuple[httpx.Response, httpx.Response, float]:
        async with httpx.AsyncClient(base_url=encoder.url, timeout=60) as client:
            first = asyncio.ensure_future(client.post("/v1/encode", json={"room": 1, "images": [image]}))
            await asyncio.to_thread(wait_until, "the encode is in flight (its room has a timeline)",
                                    lambda: httpx.get(f"{encoder.url}/rooms/1", timeout=5).status_code == 200)
            encoder.proc.send_signal(signal.SIGTERM)
            sent = time.monotonic()
            await asyncio.to_thread(wait_until, "/health says draining",
                                    lambda: health(encoder.url) == (503, {"status": "draining"}))
            refused = await client.post("/v1/encode", json={"room": 2, "images": [image]})
            return await first, refused, sent

    first, refused, sent = asyncio.run(run())
    assert first.status_code == 200 and [i["status"] for i in first.json()["images"]] == ["encoded"]
    assert (refused.status_code, refused.json()) == (503, {"error": {**DRAINING["error"], "stage": "encoder"}})
    assert encoder.proc.wait(GRACE_S) == 0 and time.monotonic() - sent < GRACE_S


def test_a_grace_that_is_not_positive_is_one_line_and_exit_2():
    for argv, role in ((("colocated", "--model", "/m"), "colocated"), (("router", "--colocated", "http://h:1"), "router")):
        done = subprocess.run([sys.executable, "-m", "cli", "serve", *argv, "--shutdown-grace-s", "0"], cwd=REPO,
                              capture_output=True, text=True, timeout=60)
        assert (done.returncode, done.stderr.strip()) == (
            2, f"stage serve {role}: error: --shutdown-grace-s must be > 0, got 0.0")
