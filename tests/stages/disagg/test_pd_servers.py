"""1P1D over real Mooncake and NIXL on loopback: parity with colocated, concurrency, the handshake's
refusals, and every failure ending in a clear error with the blocks on both sides freed."""

from __future__ import annotations

import asyncio
import signal
import time

import httpx
import pytest

from tests.support.pd_pair import FAST, Pair, blocks_used, chat, start_prefill, wait_blocks_free

pytestmark = pytest.mark.timeout(300)
@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("qwen2_vl")


@pytest.fixture(scope="module")
def colocated(start_server, model):
    return start_server("colocated", "--model", str(model), "--kv-cache-mib", "16")


@pytest.fixture(scope="module", params=["mooncake", "nixl"])
def pair(request, start_server, model):
    prefill, port = start_prefill(start_server, model, request.param)
    decode = start_server("decode", "--model", str(model), "--transfer", request.param, *FAST[:2],
                          "--kv-timeout-s", "10", "--abort-grace-s", "1")
    return Pair(prefill, decode, port)


CASES = {"text": ("hello there", []), "one_image": ("what is it", [(64, 64)]),
         "two_images": ("compare", [(64, 64), (96, 128)])}


def test_both_halves_report_the_dtype_and_pool_their_fingerprints_carry(pair):
    for server in (pair.prefill, pair.decode):
        info = httpx.get(f"{server.url}/server_info", timeout=10).json()
        engine, fingerprint = info["engine"], info["fingerprint"]
        assert engine["dtype"] == fingerprint["dtype"] == "float32"  # auto: the CPU's, or this checkpoint's on a GPU
        pool = engine["kv_pool"]
        assert (pool["block_size"], pool["block_bytes"]) == (fingerprint["block_size"], fingerprint["block_bytes"])
        assert pool["blocks"] == info["kv_blocks"]["total"] == (16 << 20) // pool["block_bytes"]
        assert (pool["bytes"], pool["source"]) == (pool["blocks"] * pool["block_bytes"], "--kv-cache-mib 16")


@pytest.mark.parametrize("case", sorted(CASES))
async def test_pd_equals_colocated(pair, colocated, case):
    text, images = CASES[case]
    body = chat(text, images, max_tokens=12)
    async with httpx.AsyncClient(timeout=60) as client:
        (p, d), c = await asyncio.gather(pair.run(client, body), client.post(f"{colocated.url}/v1/chat/completions",
                                                                             json=body))
    assert p.status_code == d.status_code == c.status_code == 200, (p.text, d.text)
    assert d.json()["choices"][0]["message"]["content"] == c.json()["choices"][0]["message"]["content"]
    same = ("prompt_tokens", "completion_tokens", "total_tokens")  # cached_tokens: each server's own cache
    assert {k: d.json()["usage"][k] for k in same} == {k: c.json()["usage"][k] for k in same}
    assert p.json()["usage"]["completion_tokens"] == 1
    assert c.json()["choices"][0]["message"]["content"].startswith(p.json()["choices"][0]["message"]["content"])
    info = httpx.get(f"{pair.prefill.url}/server_info").json()
    assert info["role"] == "prefill" and info["transfer"]["bytes"] > 0 and info["bootstrap"]["port"] == pair.bootstrap_port
    metrics = httpx.get(f"{pair.prefill.url}/metrics").text
    transfer = info["transfer_backend"]
    assert f'epd_kv_transfer_bytes{{backend="{transfer}"}} {float(info["transfer"]["bytes"])}' in metrics
    wait_blocks_free(pair.prefill, pair.decode)


async def test_sixteen_concurrent_rooms(pair, colocated):
    bodies = [chat("word " * (i + 1), [(48 + 16 * (i % 3), 64)] * (i % 2), max_tokens=6 + i % 4) for i in range(16)]
    async with httpx.AsyncClient(timeout=120) as client:
        pd = await asyncio.gather(*(pair.run(client, b) for b in bodies))
        ref = await asyncio.gather(*(client.post(f"{colocated.url}/v1/chat/completions", json=b) for b in bodies))
    for (p, d), c in zip(pd, ref):
        assert p.status_code == d.status_code == 200, (p.text, d.text)
        assert d.json()["choices"][0]["message"]["content"] == c.json()["choices"][0]["message"]["content"]
    wait_blocks_free(pair.prefill, pair.decode)


async def test_decode_stream_and_disconnect_frees_blocks(pair):
    async with httpx.AsyncClient(timeout=60) as client:
        body = pair.room(chat("stream me", max_tokens=400, stream=True))
        prefill = asyncio.ensure_future(client.post(f"{pair.prefill.url}/v1/chat/completions", json=body))
        async with client.stream("POST", f"{pair.decode.url}/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            lines = 0
            async for line in response.aiter_lines():
                lines += bool(line.startswith("data: "))
                if lines >= 4:
                    break  # hang up mid-stream
        assert (await prefill).status_code == 200
    wait_blocks_free(pair.prefill, pair.decode)


async def test_partner_never_arrives(pair):
    async with httpx.AsyncClient(timeout=60) as client:
        started = time.monotonic()
        decode_only = await client.post(f"{pair.decode.url}/v1/chat/completions", json=pair.room(chat("alone")))
        assert decode_only.status_code == 502
        assert "partner never arrived within 3 s" in decode_only.json()["error"]["message"]
        prefill_only = await client.post(f"{pair.prefill.url}/v1/chat/completions", json=pair.room(chat("alone")))
        assert prefill_only.status_code == 504
        assert "partner never arrived" in prefill_only.json()["error"]["message"]
        assert time.monotonic() - started < 15
    wait_blocks_free(pair.prefill, pair.decode)
    assert httpx.get(f"{pair.decode.url}/health").status_code == 200


async def test_a_full_kv_pool_is_back_pressure_with_retry_after(pair):
    """Rooms whose prefill half never comes hold the decode's blocks (their prompts': KV on demand)
    until the prefill expires them (--pair-timeout-s 3); a request that finds no free blocks meanwhile
    is a 503 kv_pool_full with Retry-After (a router takes it as busy, not failing), and every block
    comes back."""
    info = httpx.get(f"{pair.decode.url}/server_info", timeout=10).json()
    text = "hold on " * 600  # ~1800 prompt tokens: a decode reserves the prompt's blocks
    async with httpx.AsyncClient(timeout=60) as client:
        _, probe = await pair.run(client, chat(text, max_tokens=1))
        per_request = -(-probe.json()["usage"]["prompt_tokens"] // info["fingerprint"]["block_size"])
        holders = info["kv_blocks"]["total"] // per_request + 2  # more than the pool holds at once
        answers = await asyncio.gather(*(client.post(f"{pair.decode.url}/v1/chat/completions",
                                                     json=pair.room(chat(f"{i} {text}", max_tokens=1)))
                                         for i in range(holders)))
    full = [a for a in answers if a.status_code == 503]
    assert full and all(a.status_code == 502 for a in answers if a.status_code != 503), [a.text for a in answers]
    for answer in full:
        assert answer.headers["retry-after"] == "1"
        assert (answer.json()["error"]["code"], answer.json()["error"]["stage"]) == ("kv_pool_full", "decode")
    wait_blocks_free(pair.prefill, pair.decode)


async def test_missing_room_fields_are_a_400(pair):
    async with httpx.AsyncClient(timeout=30) as client:
        response = await client.post(f"{pair.decode.url}/v1/chat/completions", json=chat("no room"))
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["param"], error["code"]) == ("bootstrap_host", "missing_required_parameter")  # the first missing


def test_fingerprint_mismatch_names_the_flag(start_server, model, pair):
    transfer = httpx.get(f"{pair.decode.url}/server_info").json()["transfer_backend"]
    other = start_server("decode", "--model", str(model), "--transfer", transfer, "--block-size", "32", *FAST[:2])
    body = pair.room(chat("mismatch"))
    response = httpx.post(f"{other.url}/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 502
    message = response.json()["error"]["message"]
    assert "block size differs: prefill 16, decode 32; start both with the same --block-size" in message
    wait_blocks_free(other)
    other.stop()


async def test_prefill_dies_after_forward(start_server, model, pair):
    transfer = httpx.get(f"{pair.decode.url}/server_info").json()["transfer_backend"]
    doomed, port = start_prefill(start_server, model, transfer, "--debug-faults")
    armed = httpx.post(f"{doomed.url}/debug/faults", json={"point": "prefill.exit_after_forward"}, timeout=10)
    assert armed.json()["armed"] == [{"point": "prefill.exit_after_forward", "times": 1, "delay_s": 0.0}]
    body = pair.room(chat("doomed"), port=port)
    async with httpx.AsyncClient(timeout=60) as client:
        started = time.monotonic()
        p, d = await asyncio.gather(client.post(f"{doomed.url}/v1/chat/completions", json=body),
                                    client.post(f"{pair.decode.url}/v1/chat/completions", json=body),
                                    return_exceptions=True)
    assert isinstance(p, httpx.HTTPError)  # the prefill process is gone
    assert d.status_code == 502 and "prefill" in d.json()["error"]["message"]
    assert time.monotonic() - started < 20
    wait_blocks_free(pair.decode)  # after the abort grace: nobody confirmed, nothing can land later
    assert doomed.proc.wait(timeout=10) == 17


async def test_decode_dies_before_the_write(start_server, model, pair):
    transfer = httpx.get(f"{pair.decode.url}/server_info").json()["transfer_backend"]
    doomed = start_server("decode", "--model", str(model), "--transfer", transfer, *FAST[:2])
    body = pair.room(chat("orphan"))
    async with httpx.AsyncClient(timeout=60) as client:
        pending = asyncio.ensure_future(client.post(f"{doomed.url}/v1/chat/completions", json=body))
        # the decode has reserved blocks and its KV request reached the prefill (the room is known there);
        # the prefill's own half must follow within its --pair-timeout-s, so no fixed sleep here
        room = f"{pair.prefill.url}/rooms/{body['bootstrap_room']}"
        deadline = time.monotonic() + 20
        while (await client.get(room)).json().get("status") != "bootstrapping":
            assert time.monotonic() < deadline, "the decode's KV request never reached the prefill"
            await asyncio.sleep(0.02)
        doomed.proc.send_signal(signal.SIGKILL)
        with pytest.raises(httpx.HTTPError):
            await pending
        started = time.monotonic()
        p = await client.post(f"{pair.prefill.url}/v1/chat/completions", json=body)
    assert p.status_code == 502 and "KV transfer failed" in p.json()["error"]["message"], p.text
    assert time.monotonic() - started < 15
    wait_blocks_free(pair.prefill)
    assert httpx.get(f"{pair.prefill.url}/health").status_code == 200


@pytest.mark.parametrize("first", ["prefill", "decode"])
async def test_either_half_may_come_first(pair, colocated, first):
    body = pair.room(chat("who goes first", max_tokens=6))
    urls = {"prefill": f"{pair.prefill.url}/v1/chat/completions", "decode": f"{pair.decode.url}/v1/chat/completions"}
    second = "decode" if first == "prefill" else "prefill"
    async with httpx.AsyncClient(timeout=60) as client:
        early = asyncio.ensure_future(client.post(urls[first], json=body))
        await asyncio.sleep(1.0)
        late = await client.post(urls[second], json=body)
        early = await early
        reference = await client.post(f"{colocated.url}/v1/chat/completions", json=chat("who goes first", max_tokens=6))
    answers = {first: early, second: late}
    assert answers["prefill"].status_code == answers["decode"].status_code == 200
    assert answers["decode"].json()["choices"][0]["message"]["content"] == \
        reference.json()["choices"][0]["message"]["content"]
    wait_blocks_free(pair.prefill, pair.decode)


async def test_client_leaves_decode_while_it_waits_for_kv(pair):
    body = pair.room(chat("never mind"))
    async with httpx.AsyncClient(timeout=60) as client:
        waiting = asyncio.ensure_future(client.post(f"{pair.decode.url}/v1/chat/completions", json=body))
        await asyncio.sleep(1.0)  # the decode has reserved blocks and sent its KV request
        assert blocks_used(pair.decode) > 0
        waiting.cancel()  # the client hangs up
        with pytest.raises(asyncio.CancelledError):
            await waiting
        wait_blocks_free(pair.decode)  # the abort reached the prefill, which confirmed it
        late = await client.post(f"{pair.prefill.url}/v1/chat/completions", json=body)
    assert late.status_code == 409 and "aborted" in late.json()["error"]["message"]
    wait_blocks_free(pair.prefill)


async def test_prefill_dies_before_its_forward_pass(start_server, model, pair):
    transfer = httpx.get(f"{pair.decode.url}/server_info").json()["transfer_backend"]
    doomed, port = start_prefill(start_server, model, transfer, "--debug-faults")
    armed = httpx.post(f"{doomed.url}/debug/faults", json={"point": "prefill.exit_before_forward"}, timeout=10)
    assert armed.json()["armed"] == [{"point": "prefill.exit_before_forward", "times": 1, "delay_s": 0.0}]
    body = pair.room(chat("too late"), port=port)
    async with httpx.AsyncClient(timeout=60) as client:
        started = time.monotonic()
        p, d = await asyncio.gather(client.post(f"{doomed.url}/v1/chat/completions", json=body),
                                    client.post(f"{pair.decode.url}/v1/chat/completions", json=body),
                                    return_exceptions=True)
    assert isinstance(p, httpx.HTTPError)  # the prefill process is gone
    assert d.status_code == 502 and "lost connection to prefill" in d.json()["error"]["message"], d.text
    assert time.monotonic() - started < 5
    assert doomed.proc.wait(timeout=10) == 17
    wait_blocks_free(pair.decode)  # after the abort grace: nobody confirmed, nothing can land later
