"""The router in pd mode, as a real process in front of real prefill and decode servers over Mooncake
(two of each, plus a decode whose fingerprint differs): greedy parity with a colocated server through
the official client, 32 concurrent mixed requests, a retry on a fresh pair, a client that leaves,
and a decode killed mid-stream. KV blocks are back to zero on every stage after each test."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

from process.ports import free_port
from tests.conftest import REPO
from tests.support.router_helpers import arm, ask, data_url, messages, metric, mixed_answers, png, wait_metric

pytestmark = pytest.mark.timeout(240)
FAST = ["--kv-cache-mib", "16", "--transfer", "mooncake", "--pair-timeout-s", "5", "--transfer-timeout-s", "5"]


def blocks_used(server) -> int:
    return httpx.get(f"{server.url}/server_info", timeout=10).json()["kv_blocks"]["used"]


def wait_blocks_free(servers, within_s: float = 10.0) -> None:
    deadline = time.monotonic() + within_s
    while used := [blocks_used(s) for s in servers if s.proc.poll() is None]:
        if not any(used):
            return
        assert time.monotonic() < deadline, f"blocks still in use: {used}"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def model(tiny_model):
    return str(tiny_model("qwen2_vl"))


@pytest.fixture(scope="module")
def colocated(start_server, model):
    return start_server("colocated", "--model", model, "--kv-cache-mib", "16")


@pytest.fixture(scope="module")
def prefills(start_server, model):
    return [start_server("prefill", "--model", model, *FAST, "--bootstrap-port", str(free_port()), "--debug-faults")
            for _ in range(2)]


@pytest.fixture(scope="module")
def decodes(start_server, model):
    return [start_server("decode", "--model", model, *FAST, "--kv-timeout-s", "10", "--abort-grace-s", "1")
            for _ in range(2)]


@pytest.fixture(scope="module")
def odd_decode(start_server, model):
    """A decode whose KV blocks are twice as long: no prefill here may feed it."""
    return start_server("decode", "--model", model, *FAST, "--block-size", "32")


@pytest.fixture(scope="module")
def router(start_server, prefills, decodes, odd_decode):
    flags = [flag for p in prefills for flag in ("--prefill", p.url)]
    flags += [flag for d in (*decodes, odd_decode) for flag in ("--decode", d.url)]
    return start_server("router", *flags, "--upstream-timeout-s", "30", "--health-interval-s", "0.5")


@pytest.fixture(autouse=True)
def stages_end_clean(prefills, decodes, odd_decode):
    yield
    wait_blocks_free([*prefills, *decodes, odd_decode])


def chat_body(i: int) -> tuple[list[dict], int, bool]:
    """Request ``i`` of a mixed load: 0 to 3 images of different sizes, stream or not, 4 to 11 tokens."""
    urls = [data_url(png(32 + 16 * ((i + k) % 3), 48 + 16 * k, 100 + i + k)) for k in range(i % 4)]
    return messages(f"request {i}: " + "word " * (i % 5), urls), 4 + i % 8, i % 2 == 1


# --- startup ---------------------------------------------------------------------------------
def test_incompatible_pairs_are_named_at_startup(router, prefills, odd_decode):
    for p in prefills:
        assert (f"prefill {p.url} and decode {odd_decode.url} are never paired: their fingerprints differ "
                "(block_bytes: 8192 != 16384; block_size: 16 != 32)") in router.log()
    assert httpx.get(f"{router.url}/health").json() == {"status": "ok", "mode": "pd"}


def test_refuses_to_start_without_a_compatible_pair(prefills, odd_decode):
    result = subprocess.run([sys.executable, "-m", "cli", "serve", "router", "--port", str(free_port()),
                             "--prefill", prefills[0].url, "--decode", odd_decode.url],
                            cwd=REPO, capture_output=True, text=True, timeout=30)
    assert result.returncode == 2
    assert (f"stage serve router: cannot start: no prefill and decode can be paired: prefill {prefills[0].url} and "
            f"decode {odd_decode.url} are never paired: their fingerprints differ (block_bytes: 8192 != 16384; "
            "block_size: 16 != 32)") in result.stderr


def test_refuses_a_worker_given_as_the_wrong_role_at_once(decodes):
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "cli", "serve", "router", "--port", str(free_port()),
                             "--prefill", decodes[0].url, "--decode", decodes[1].url],
                            cwd=REPO, capture_output=True, text=True, timeout=30)
    assert result.returncode == 2 and time.monotonic() - started < 15
    assert (f"stage serve router: cannot start: {decodes[0].url} is a 'decode' server, given as --prefill"
            in result.stderr)


# --- parity and load -------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("n_images", [0, 1, 3])
def test_same_answer_as_colocated(router, colocated, stream, n_images):
    msgs = messages(f"pd {n_images}", [data_url(png(32 + 16 * i, 64, 20 + i)) for i in range(n_images)])
    via_router = ask(router.base_url, msgs, stream)
    assert via_router == ask(colocated.base_url, msgs, stream)
    assert via_router[1]["completion_tokens"] == 12


async def test_32_concurrent_mixed_requests(router, colocated, prefills, decodes, odd_decode):
    await mixed_answers(router.url, router.base_url, colocated.base_url, chat_body)
    for stage in (*prefills, *decodes):  # the policies spread the load over both of each
        assert metric(stage.url, 'epd_requests_total{finish_reason="length"}') > 0, stage.url
    assert metric(odd_decode.url, 'epd_requests_total{finish_reason="length"}') == 0


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_metrics_of_one_request(router, stream):
    """docs/router.md, "When they are recorded": every stage's time (and a stream's TTFT and TPOT) is recorded before
    the client's last byte, so it is there when the answer is; the outcome and the end-to-end time
    just after it (polled)."""
    settled = ['epd_router_stage_seconds_count{stage="prefill"}', 'epd_router_stage_seconds_count{stage="decode"}']
    if stream:
        settled += ["epd_router_time_to_first_token_seconds_count", "epd_router_time_per_output_token_seconds_count"]
    after = ["epd_router_e2e_request_latency_seconds_count", 'epd_router_requests_total{outcome="success"}']
    before = {name: metric(router.url, name) for name in (*settled, *after)}
    ask(router.base_url, messages("count me", []), stream=stream)
    assert {name: metric(router.url, name) - before[name] for name in settled} == {name: 1 for name in settled}
    for name in after:
        wait_metric(router.url, name, before[name] + 1)
    assert metric(router.url, 'epd_router_retries_total{stage="decode"}') == 0


# --- failures --------------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_a_prefill_failure_is_retried_on_a_fresh_pair(router, colocated, prefills, stream):
    """One prefill fails its next room (500 after the forward pass): the request that drew it is retried
    on the other prefill with a new room, and the client sees only the right answer. Streamed too: the
    decode sends nothing but its in-band error before the KV would have come (its role chunk leaves
    with the first token), so the router has committed nothing when the prefill fails."""
    retries = metric(router.url, 'epd_router_retries_total{stage="prefill"}')
    arm(prefills[0], "prefill.crash", times=1)
    msgs = messages("retry me", [data_url(png(48, 48, 7))])
    expected = ask(colocated.base_url, msgs, stream=False)
    assert [ask(router.base_url, msgs, stream=stream) for _ in range(2)] == [expected, expected]
    wait_metric(router.url, 'epd_router_retries_total{stage="prefill"}', retries + 1)
    assert "prefill stage http://127.0.0.1:" in router.log() and "failed before the answer started" in router.log()


async def test_client_leaving_mid_stream_aborts_the_room_everywhere(router, prefills, decodes):
    aborted = metric(router.url, 'epd_router_requests_total{outcome="aborted"}')
    body = {"messages": messages("leave", [data_url(png(64, 64, 3))]), "max_tokens": 400, "ignore_eos": True,
            "stream": True}
    async with httpx.AsyncClient(timeout=60) as client:
        async with client.stream("POST", f"{router.url}/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            seen = 0
            async for line in response.aiter_lines():
                seen += line.startswith("data: ")
                if seen >= 4:
                    break
            assert sum(blocks_used(d) for d in decodes) > 0  # the room is still decoding as the client leaves
    wait_blocks_free([*prefills, *decodes])
    wait_metric(router.url, 'epd_router_requests_total{outcome="aborted"}', aborted + 1)
    wait_metric(router.url, "epd_router_in_flight_requests", 0.0)


async def test_client_leaving_a_json_request_aborts_the_room_everywhere(router, prefills, decodes):
    body = {"messages": messages("wait", []), "max_tokens": 1500, "ignore_eos": True}
    async with httpx.AsyncClient(timeout=60) as client:
        with pytest.raises(httpx.ReadTimeout):
            await client.post(f"{router.url}/v1/chat/completions", json=body, timeout=1.0)
    wait_blocks_free([*prefills, *decodes])


def test_decode_killed_mid_stream(router, colocated, decodes):
    """The client gets an error event naming the decode at once, the decode is marked unhealthy, and the
    next requests go to the other decode."""
    client = openai.OpenAI(base_url=router.base_url, api_key="x", max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    stream = client.chat.completions.create(model=model, messages=messages("doomed", []), max_tokens=1500,
                                            temperature=0, stream=True, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    for _ in range(4):
        next(chunks)
    busy = [d for d in decodes if blocks_used(d)]
    assert len(busy) == 1
    victim, survivor = busy[0], next(d for d in decodes if d is not busy[0])
    victim.proc.send_signal(signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(openai.APIError) as error:
        for _ in chunks:
            pass
    assert time.monotonic() - started < 5
    assert error.value.message == (f"The decode stage failed: {victim.url} could not be reached or went away: "
                                   "the connection closed before the answer was complete")
    assert error.value.body["code"] == "upstream_unavailable" and error.value.body["type"] == "server_error"
    wait_metric(router.url, f'epd_router_worker_healthy{{role="decode",worker="{victim.url}"}}', 0.0)
    length = metric(survivor.url, 'epd_requests_total{finish_reason="length"}')
    msgs = messages("after the kill", [data_url(png(40, 40, 9))])
    expected = ask(colocated.base_url, msgs, stream=True)
    assert [ask(router.base_url, msgs, stream=i % 2 == 1) for i in range(4)] == [expected] * 4
    assert metric(survivor.url, 'epd_requests_total{finish_reason="length"}') == length + 4
    assert httpx.get(f"{router.url}/health").json() == {"status": "ok", "mode": "pd"}
