"""A silent upstream stream, end to end: the router in pd mode (default deadlines) in front of two real
prefill/decode pairs over Mooncake.

- A decode frozen with SIGSTOP mid-stream (a silent host: no RST, its kernel still ACKs) under
  concurrent streams: each client's stream on it ends within 10 s with the in-band error
  ``upstream_idle_timeout`` naming the decode (``--stream-idle-timeout-s``, 6 s); the other pair keeps
  serving; after SIGCONT the decode is readmitted by the health loop and serves; KV blocks go back to 0.
- A slow but live decode (``stream.slow_token``: each token held longer than the idle deadline) is
  never cut: its ``: keep-alive`` comments (``--stream-keepalive-s``, 2 s) reach the client between
  the tokens, and the answer is the greedy one.
- A decode waiting 7 s for its KV (``prefill.delay_ready``) is not cut either: it sends keep-alives
  while it waits. A colocated stage sends them too (on the wire, straight from the stage).
- Every upstream connection probes its peer's host (``--upstream-host-timeout-s``: TCP keepalive and
  TCP_USER_TIMEOUT on the socket), which bounds a JSON call to a vanished host.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import time

import httpx
import openai
import pytest
from aiohttp import web

from router.fleet.breaker import CircuitBreaker
from router.config import RouterConfig
from router.upstream.client import StageError, Upstream
from router.dispatch.verdict import Failure
from router.fleet.workers import Worker
from process.ports import free_port
from tests.support.router_helpers import arm, metric

pytestmark = pytest.mark.timeout(180)
FAST = ["--kv-cache-mib", "16", "--transfer", "mooncake", "--pair-timeout-s", "5", "--transfer-timeout-s", "5"]
IDLE_S = 6.0  # the router's default --stream-idle-timeout-s
WITHIN_S = 10.0  # issue 16: a vanished decode ends the client's stream within this
PACE_S = 0.25  # stream.slow_token delay that keeps the streams open while the decode is frozen


@pytest.fixture(scope="module")
def model(tiny_model):
    return str(tiny_model("qwen2_vl"))


@pytest.fixture(scope="module")
def prefills(start_server, model):
    return [start_server("prefill", "--model", model, *FAST, "--bootstrap-port", str(free_port()), "--debug-faults")
            for _ in range(2)]


@pytest.fixture(scope="module")
def decodes(start_server, model):
    return [start_server("decode", "--model", model, *FAST, "--kv-timeout-s", "10", "--abort-grace-s", "1",
                         "--debug-faults") for _ in range(2)]


@pytest.fixture(scope="module")
def router(start_server, prefills, decodes):
    """Default deadlines but a quick health loop (readmission is what it measures)."""
    flags = [flag for p in prefills for flag in ("--prefill", p.url)]
    flags += [flag for d in decodes for flag in ("--decode", d.url)]
    return start_server("router", *flags, "--health-interval-s", "0.5")


def blocks_used(server) -> int:
    return httpx.get(f"{server.url}/server_info", timeout=10).json()["kv_blocks"]["used"]


def wait_until(what: str, check, within_s: float) -> None:
    deadline = time.monotonic() + within_s
    while not check():
        assert time.monotonic() < deadline, f"not within {within_s} s: {what}"
        time.sleep(0.1)


def healthy(router, decode) -> float:
    return metric(router.url, f'epd_router_worker_healthy{{role="decode",worker="{decode.url}"}}')


def served(decode) -> float:
    return metric(decode.url, 'epd_requests_total{finish_reason="length"}')


@pytest.fixture
def clean_stages(prefills, decodes):
    yield
    for prefill in prefills:
        arm(prefill, "prefill.delay_ready", 1, 0.0)
    for decode in decodes:
        arm(decode, "stream.slow_token", 1, 0.0)  # replaces what a test left armed with one harmless use
    wait_until("KV blocks back to 0 on every stage",
               lambda: not any(blocks_used(s) for s in (*prefills, *decodes)), 15.0)


def body(text: str, max_tokens: int) -> dict:
    return dict(messages=[{"role": "user", "content": text}], max_tokens=max_tokens, temperature=0,
                extra_body={"ignore_eos": True})


async def stream_until_end(client: openai.AsyncOpenAI, model_id: str, i: int, texted: asyncio.Event) -> dict:
    """One stream through the official client: its text, and how it ended (done, or the error's body
    and when it came)."""
    text = ""
    try:
        stream = await client.chat.completions.create(model=model_id, stream=True, **body(f"stream {i}", 60))
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                text += chunk.choices[0].delta.content
                texted.set()
    except openai.APIError as exc:
        return {"text": text, "error": exc.body, "at": time.monotonic()}
    return {"text": text, "error": None, "at": time.monotonic()}


@pytest.mark.usefixtures("clean_stages")
async def test_a_frozen_decode_ends_its_streams_within_10_s_and_is_readmitted(router, decodes):
    frozen, other = decodes
    for decode in decodes:
        arm(decode, "stream.slow_token", 100_000, PACE_S)  # 60 tokens: 15 s a stream, open when the decode freezes
    client = openai.AsyncOpenAI(base_url=router.base_url, api_key="x", max_retries=0, timeout=60)
    model_id = (await client.models.list()).data[0].id
    tasks = []
    for i in range(4):  # one at a time, each under way before the next: least_load alternates the decodes
        texted = asyncio.Event()
        tasks.append(asyncio.ensure_future(stream_until_end(client, model_id, i, texted)))
        await asyncio.wait_for(texted.wait(), 30)
    frozen.proc.send_signal(signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        ends = await asyncio.wait_for(asyncio.gather(*tasks), 40)
        cut = [end for end in ends if end["error"] is not None]
        assert len(cut) == 2, ends  # the two streams on the frozen decode
        for end in cut:
            assert end["at"] - stopped_at < WITHIN_S, end
            assert end["at"] - stopped_at > IDLE_S - 1, end  # no keep-alive came, so nothing before the deadline
            assert end["text"], end  # it was mid-stream
            assert end["error"] == {
                "message": f"The decode stage failed: {frozen.url} sent nothing for 6 s on an open stream, "
                           "keep-alives included (--stream-idle-timeout-s)",
                "type": "server_error", "param": None, "code": "upstream_idle_timeout", "stage": "decode"}
        assert [len(end["text"]) > 0 and end["error"] is None for end in ends].count(True) == 2
        assert healthy(router, frozen) == 0.0  # marked at once, and the health loop keeps it out
        arm(other, "stream.slow_token", 1, 0.0)
        before = served(other)
        answers = await asyncio.gather(*(client.chat.completions.create(model=model_id, **body(f"meanwhile {i}", 4))
                                         for i in range(3)))
        assert [a.usage.completion_tokens for a in answers] == [4, 4, 4]
        assert served(other) == before + 3
    finally:
        frozen.proc.send_signal(signal.SIGCONT)
    arm(frozen, "stream.slow_token", 1, 0.0)
    wait_until("the frozen decode readmitted", lambda: healthy(router, frozen) == 1.0, 15.0)
    before = served(frozen)
    for i in range(4):  # least_load over two idle decodes: the readmitted one gets some
        answer = await client.chat.completions.create(model=model_id, **body(f"after {i}", 4))
        assert answer.usage.completion_tokens == 4
    assert served(frozen) > before
    await client.close()


@pytest.mark.usefixtures("clean_stages")
def test_a_slow_but_live_decode_is_never_cut(router, decodes):
    """Each token held 7 s (> the 6 s idle deadline): the decode's keep-alives flow between them, the
    router forwards them, and the answer is the greedy one."""
    with httpx.Client(timeout=60) as client:
        request = {"messages": [{"role": "user", "content": "slow"}], "max_tokens": 3, "temperature": 0,
                   "ignore_eos": True, "stream": True}
        reference = client.post(f"{router.url}/v1/chat/completions", json={**request, "stream": False}).json()
        for decode in decodes:  # whichever decode the router picks
            arm(decode, "stream.slow_token", 2, 7.0)
        started = time.monotonic()
        events = []
        with client.stream("POST", f"{router.url}/v1/chat/completions", json=request) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line:
                    events.append(line)
    assert time.monotonic() - started > 14
    texts = [e for e in events if e.startswith("data: {") and '"content":"' in e and '"content":""' not in e]
    assert len(texts) == 3, events
    # the first token's wait happened before the answer was committed (nothing forwarded yet); the second
    # token's 7 s came after it: a keep-alive each 2 s of silence
    between = events[events.index(texts[0]) + 1:events.index(texts[1])]
    assert between == [": keep-alive"] * 3, events
    assert "error" not in "".join(events) and events[-1] == "data: [DONE]"
    assert stream_text(events) == reference["choices"][0]["message"]["content"]


@pytest.mark.usefixtures("clean_stages")
def test_the_decode_waiting_for_its_kv_is_not_cut(router, prefills):
    """The prefill holds KVReady 7 s (> the 6 s idle deadline) after writing the KV: the decode's
    keep-alives during its KV wait keep the router's deadline from firing; the answer is the greedy one."""
    with httpx.Client(timeout=60) as client:
        request = {"messages": [{"role": "user", "content": "kv wait"}], "max_tokens": 3, "temperature": 0,
                   "ignore_eos": True}
        reference = client.post(f"{router.url}/v1/chat/completions", json=request).json()
        for prefill in prefills:  # whichever prefill the router picks
            arm(prefill, "prefill.delay_ready", 1, 7.0)
        started = time.monotonic()
        with client.stream("POST", f"{router.url}/v1/chat/completions", json={**request, "stream": True}) as response:
            assert response.status_code == 200
            events = [line for line in response.iter_lines() if line]
    assert time.monotonic() - started > 7
    assert "error" not in "".join(events) and events[-1] == "data: [DONE]"
    assert stream_text(events) == reference["choices"][0]["message"]["content"]


@pytest.fixture(scope="module")
def colocated(start_server, model):
    return start_server("colocated", "--model", model, "--kv-cache-mib", "16", "--debug-faults",
                        "--stream-keepalive-s", "1")


def test_a_colocated_stream_says_keep_alive_while_it_has_nothing_to_say(colocated):
    """Straight from the stage (--stream-keepalive-s 1): the first token held 2.5 s gives two
    ``: keep-alive`` comments, then the role chunk with the first token (a stage's first event is its
    first output), the tokens that follow at once none; the text is the
    JSON answer's, and the official client reads the stream as if they were not there."""
    request = {"messages": [{"role": "user", "content": "colocated"}], "max_tokens": 4, "temperature": 0,
               "ignore_eos": True}
    with httpx.Client(timeout=60) as client:
        reference = client.post(f"{colocated.url}/v1/chat/completions", json=request).json()
        arm(colocated, "stream.slow_token", 1, 2.5)
        with client.stream("POST", f"{colocated.url}/v1/chat/completions", json={**request, "stream": True}) as response:
            events = [line for line in response.iter_lines() if line]
    text = reference["choices"][0]["message"]["content"]
    assert events[:2] == [": keep-alive"] * 2 and events.count(": keep-alive") == 2, events
    assert json.loads(events[2][6:])["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert stream_text(events) == text
    arm(colocated, "stream.slow_token", 1, 2.5)
    client = openai.OpenAI(base_url=colocated.base_url, api_key="x", max_retries=0, timeout=60)
    chunks = list(client.chat.completions.create(model=client.models.list().data[0].id, stream=True,
                                                 **body("colocated", 4)))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text


def stream_text(events: list[str]) -> str:
    return "".join((json.loads(e[6:])["choices"] or [{}])[0].get("delta", {}).get("content") or ""
                   for e in events if e.startswith("data: {"))


async def hold_open(release: asyncio.Event, pieces: list[tuple[float, bytes]]) -> tuple[web.AppRunner, str]:
    """A loopback server whose ``/held`` answer writes each (seconds later, bytes) piece, then holds the
    connection open, silent, until ``release`` is set (bounded: 30 s)."""

    async def held(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        for delay_s, data in pieces:
            await asyncio.sleep(delay_s)  # the server's pace, not a synchronization
            await response.write(data)
        await asyncio.wait_for(release.wait(), 30)
        return response

    app = web.Application()
    app.router.add_get("/held", held)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


async def test_a_stream_silent_past_the_idle_deadline_is_a_stage_error_naming_it():
    """``Upstream.chunks`` on a real connection: keep-alive comments 0.3 s apart keep a 0.5 s deadline
    from firing; silence past it raises ``upstream_idle_timeout`` naming the stage, within the deadline."""
    release = asyncio.Event()
    pieces = [(0.0, b": keep-alive\n\n")] + [(0.3, b": keep-alive\n\n")] * 4
    runner, url = await hold_open(release, pieces)
    config = RouterConfig(colocated=(url,), stream_idle_timeout_s=0.5)
    upstream = Upstream(config)
    await upstream.start()
    worker = Worker(url, "colocated", CircuitBreaker(3, 10.0))
    try:
        response = await upstream.request("colocated", worker, b"GET", "/held")
        got = b""
        with pytest.raises(StageError) as caught:
            async for data in upstream.chunks("colocated", worker, response):
                got += data
                last = time.monotonic()
        silent_s = time.monotonic() - last
        response.close()
        assert got == b": keep-alive\n\n" * 5
        assert 0.5 <= silent_s < 1.5
        assert caught.value.failure == Failure(
            "colocated", url, 504, f"{url} sent nothing for 0.5 s on an open stream, keep-alives included "
            "(--stream-idle-timeout-s)", "upstream_idle_timeout", unreachable=True)
    finally:
        release.set()
        await upstream.close()
        await runner.cleanup()


async def test_upstream_connections_probe_the_peer_host():
    """TCP keepalive from 1 s idle, one probe a second, dropped after 4 unanswered (5 s default), and
    TCP_USER_TIMEOUT 5000 ms for unacknowledged data, on the socket of a live upstream call (to a
    loopback server that holds its answer open)."""
    release = asyncio.Event()
    runner, url = await hold_open(release, [(0.0, b"first")])
    upstream = Upstream(RouterConfig(colocated=(url,)))
    await upstream.start()
    try:
        for client in ("hot path", "aiohttp session"):  # a stage's calls, and discovery's and health's
            if client == "hot path":
                worker = Worker(url, "colocated", CircuitBreaker(3, 10.0))
                response = await upstream.request("colocated", worker, b"GET", "/held")
                transport = response.connection.transport
            else:
                response = await upstream.session.get(f"{url}/held")
                transport = response.connection.transport
            sock = transport.get_extra_info("socket")
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 1
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL) == 1
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == 4
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 5000
            release.set()
            if client == "hot path":
                assert await upstream.read("colocated", worker, response) == b"first"
            else:
                assert await response.read() == b"first"
    finally:
        await upstream.close()
        await runner.cleanup()
