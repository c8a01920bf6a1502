"""P/D liveness with default deadlines: a prefill or decode that vanishes (SIGSTOP: no RST, no FIN,
nothing) during a room, under 8 concurrent requests through a real router in front of two prefills
and two decodes (Mooncake over loopback).

- The prefill stops while the decode waits for its KV: its heartbeats stop, the decode fails the room
  after ``--peer-idle-timeout-s`` (504 naming the prefill; the router retries it on a fresh pair, or
  answers 502/504 naming the prefill), every client has its answer within 10 s,
  requests meanwhile succeed on the other prefill, and once the prefill resumes it answers the queued
  aborts, so every reserved block comes back.
- The decode stops while the prefill holds its rooms: the prefill's rooms end within its own
  deadlines and its blocks come back while the decode is still stopped.

Only the flags a test needs to reach a server are given (ports, fault points); every deadline is the
default.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, contextmanager

import httpx
import openai
import pytest

from process.ports import free_port
from tests.support.process_stop import stopped as process_stopped
from tests.support.router_helpers import arm, messages, metric

pytestmark = pytest.mark.timeout(240)
DEADLINE_S = 10.0
# a frozen stage is out of rotation within --health-timeouts x (--health-interval-s + --health-timeout-s)
# of the stop (docs/router.md, "Deadlines"), sooner if a request saw it go silent; plus a check's slack
OUT_OF_ROTATION_S = 3 * (2.0 + 2.0) + 2.0
CONCURRENT = 8
LOAD_S = 30.0  # for the first wave to reach the victim before the stop: a precondition, not the bound under test
POOL = ["--kv-cache-mib", "16"]


def blocks_used(server) -> int:
    return httpx.get(f"{server.url}/server_info", timeout=10).json()["kv_blocks"]["used"]


def wait_until(check, within_s: float, what: str) -> None:
    deadline = time.monotonic() + within_s
    while not check():
        assert time.monotonic() < deadline, f"not within {within_s} s: {what}"
        time.sleep(0.05)


@contextmanager
def stopped(server):
    """The server's process is stopped (SIGSTOP: its sockets stay open and silent) until the block ends."""
    with process_stopped(server.proc.pid):
        yield


@pytest.fixture(scope="module")
def model(tiny_model):
    return str(tiny_model("qwen2_vl"))


@pytest.fixture(scope="module")
def prefills(start_server, model):
    return [start_server("prefill", "--model", model, *POOL, "--bootstrap-port", str(free_port()), "--debug-faults")
            for _ in range(2)]


@pytest.fixture(scope="module")
def decodes(start_server, model):
    return [start_server("decode", "--model", model, *POOL) for _ in range(2)]


@pytest.fixture(scope="module")
def router(start_server, prefills, decodes):
    flags = [flag for p in prefills for flag in ("--prefill", p.url)]
    flags += [flag for d in decodes for flag in ("--decode", d.url)]
    return start_server("router", *flags)


@pytest.fixture(autouse=True)
def stages_end_clean(prefills, decodes):
    yield
    servers = [*prefills, *decodes]
    wait_until(lambda: not any(blocks_used(s) for s in servers), 15, "KV blocks back to 0 on every P and D")


async def ask(client: openai.AsyncOpenAI, model: str, text: str) -> tuple[float, str | openai.APIStatusError]:
    """(seconds, the answer's text or its error) of one greedy request through the router."""
    started = time.monotonic()
    try:
        answer = await client.chat.completions.create(model=model, messages=messages(text, []), max_tokens=4,
                                                      temperature=0)
        return time.monotonic() - started, answer.choices[0].message.content or ""
    except openai.APIStatusError as error:
        return time.monotonic() - started, error


@asynccontextmanager
async def client_of(router) -> AsyncIterator[tuple[openai.AsyncOpenAI, str]]:
    """An OpenAI client of the router and its model, closed on leaving: an unclosed client schedules
    its close on whichever event loop runs when it is collected, a later test's."""
    model = httpx.get(f"{router.url}/v1/models", timeout=10).json()["data"][0]["id"]
    async with openai.AsyncOpenAI(base_url=router.base_url, api_key="x", max_retries=0, timeout=60) as client:
        yield client, model


async def test_a_prefill_that_vanishes_mid_room_costs_seconds_not_the_kv_timeout(router, prefills, decodes):
    victim, survivor = prefills
    async with client_of(router) as (client, model):
        arm(victim, "prefill.delay_ready", CONCURRENT, delay_s=3.0)  # its rooms hold after the write
        first = [asyncio.create_task(ask(client, model, f"first wave {i}")) for i in range(CONCURRENT)]
        await asyncio.to_thread(wait_until, lambda: _taken(victim, "prefill.delay_ready", CONCURRENT), 20,
                                "rooms written and held on the victim prefill")
        with stopped(victim):
            stopped_at = time.monotonic()
            answers = await asyncio.gather(*first)
            ended = time.monotonic() - stopped_at
            meanwhile = await asyncio.gather(*(ask(client, model, f"meanwhile {i}") for i in range(CONCURRENT)))
            held = sum(map(blocks_used, decodes))
        assert ended < DEADLINE_S, answers
        for _, answer in answers:  # the router retries a failed room once on a fresh pair: most succeed
            if isinstance(answer, openai.APIStatusError):
                assert answer.status_code in (502, 504), answer.body
                assert answer.message.startswith("The prefill stage failed"), answer.message
                assert victim.url in answer.message and "went silent" in answer.message, answer.message
        silent = (f"prefill stage {victim.url} failed before the answer started: "
                  "the decode stage reports: bootstrap room")
        assert router.log().count(silent) >= 1, "no room was failed for the stopped prefill's silence"
        assert "went silent" in router.log() and "--peer-idle-timeout-s 5;" in router.log()
        assert all(seconds < DEADLINE_S and isinstance(answer, str) for seconds, answer in meanwhile), meanwhile
        assert held > 0  # the failed rooms' blocks wait for the stopped prefill's word ...
        # ... which it gives once it runs again: the queued aborts are answered and the blocks come back
        await asyncio.to_thread(wait_until, lambda: sum(map(blocks_used, decodes)) == 0, 20, "decode blocks freed")


def _taken(server, point: str, armed: int) -> bool:
    """The server took its fault point ``point`` (armed ``armed`` times) at least once."""
    left = [f["times"] for f in httpx.get(f"{server.url}/debug/faults", timeout=10).json()["armed"]
            if f["point"] == point]
    return not left or left[0] < armed


async def test_a_slow_prefill_that_is_alive_is_never_cut_by_the_idle_bound(router, prefills, decodes):
    """Both prefills' engines stall 7 s (longer than the decodes' default 5 s idle bound, as a long
    prompt on a slow CPU would): their heartbeats go on, so every room waits and succeeds. The stall
    is armed on idle engines and starts with each prefill's first room (``engine.stall`` waits for a
    step with work), however long the requests take to arrive."""
    async with client_of(router) as (client, model):
        silent_before = "".join(d.log() for d in decodes).count("went silent")
        for prefill in prefills:
            arm(prefill, "engine.stall", 1, delay_s=7.0)
        answers = await asyncio.gather(*(ask(client, model, f"slow prefill {i}") for i in range(CONCURRENT)))
        assert all(isinstance(answer, str) and answer for _, answer in answers), answers
        assert max(seconds for seconds, _ in answers) > 7.0  # they did wait out the whole stall
        assert "".join(d.log() for d in decodes).count("went silent") == silent_before


async def test_a_decode_that_vanishes_leaves_the_prefill_clean(router, prefills, decodes):
    """The prefills' engines pause while the rooms pair, the decode stops, then the prefills forward
    and write into the stopped decode: those writes fail at ``--transfer-timeout-s`` and the prefills'
    blocks come back at once (not after the in-flight slack), within 10 s of the stop, with the decode
    still stopped. Once it resumes, the room's requests end (the router retries them)."""
    async with client_of(router) as (client, model):
        before = sum(_failures(p) for p in prefills)
        for prefill in prefills:
            arm(prefill, "engine.stall", 1, delay_s=1.5)
        requests = [asyncio.create_task(ask(client, model, f"to a stopped decode {i}")) for i in range(CONCURRENT)]
        victim = decodes[0]
        await asyncio.to_thread(wait_until, lambda: blocks_used(victim) > 0, 10, "rooms reserved on the victim decode")
        with stopped(victim):
            stopped_at = time.monotonic()
            await asyncio.to_thread(wait_until, lambda: sum(_failures(p) for p in prefills) > before
                                    and not any(map(blocks_used, prefills)), DEADLINE_S,
                                    "the writes into the stopped decode failed and the prefill blocks were freed")
            assert time.monotonic() - stopped_at < DEADLINE_S
        answers = await asyncio.wait_for(asyncio.gather(*requests), 60)
        assert all(isinstance(answer, str) or answer.status_code in (502, 504) for _, answer in answers), answers


def _failures(prefill) -> int:
    """The prefill's failed KV writes so far."""
    return httpx.get(f"{prefill.url}/server_info", timeout=10).json()["transfer"]["failures"]


async def test_a_blackholed_decode_costs_no_stream_more_than_10_s(router, decodes):
    """The router's path to one decode goes silent (SIGSTOP: connections open, nothing answers) while
    8 streams are in flight and more come: every client has its answer (the text, or an error naming
    the decode) within 10 s, the other decode serves the rest, and the router takes the decode out of
    rotation within OUT_OF_ROTATION_S of the stop. (A JSON call to a frozen process on a live host is
    bounded by ``--upstream-timeout-s`` only: docs/router.md, "Deadlines".)"""
    victim, survivor = decodes
    async with client_of(router) as (client, model):

        async def one(i: int) -> tuple[float, float, str | openai.APIError]:
            """(started, ended, the text or the error)"""
            started = time.monotonic()
            try:
                chunks = await client.chat.completions.create(
                    model=model, messages=messages(f"blackhole {i}", []), max_tokens=300, temperature=0, stream=True,
                    extra_body={"ignore_eos": True})
                text = "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])
                return started, time.monotonic(), text
            except openai.APIError as error:
                return started, time.monotonic(), error

        healthy = f'epd_router_worker_healthy{{role="decode",worker="{victim.url}"}}'
        first = [asyncio.create_task(one(i)) for i in range(CONCURRENT)]
        await asyncio.to_thread(wait_until, lambda: blocks_used(victim) > 0, LOAD_S, "streams on the victim decode")
        with stopped(victim):
            stopped_at = time.monotonic()
            answers = await asyncio.gather(*first)
            later = await asyncio.gather(*(one(CONCURRENT + i) for i in range(CONCURRENT)))
            left_s = max(0.0, stopped_at + OUT_OF_ROTATION_S - time.monotonic())
            await asyncio.to_thread(wait_until, lambda: metric(router.url, healthy) == 0.0, left_s,
                                    f"the stopped decode out of rotation {OUT_OF_ROTATION_S} s after the stop")
        # what the blackhole costs a stream: from the stop (or its start, if later) to its answer; the
        # first wave's time before the stop is the load's, not the fault's (one loaded core: seconds)
        for started, ended, answer in [*answers, *later]:
            assert ended - max(started, stopped_at) < DEADLINE_S, (ended - started, ended - stopped_at, answer)
            if not isinstance(answer, str):
                assert "decode" in str(answer.message) and victim.url in str(answer.message), answer.message
        assert all(isinstance(answer, str) and answer for _, _, answer in later), later
