"""Fault points (``stages.faults``) on real prefill and decode servers over Mooncake on loopback:
each fault ends in the answer it should (status, code, exact message), the blocks on both sides
go back to zero, and the pair keeps serving the same text afterwards. A dead supervised task
turns /health into a 503 that names it."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from stages.supervisor import Supervisor
from tests.support.pd_pair import FAST, Pair, arm, blocks_used, chat, error, start_prefill, wait_blocks_free
from transfer.bootstrap_client import BootstrapClient
from transfer.bootstrap_server import BootstrapServer
from transfer.fingerprint import Fingerprint
from transfer.messages import KVRequest

pytestmark = pytest.mark.timeout(300)
KV_TIMEOUT_S = 3
BODY = chat("the same words after every fault", max_tokens=8)


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("qwen2_vl")


@pytest.fixture(scope="module")
def pair(start_server, model) -> Pair:
    prefill, port = start_prefill(start_server, model, "mooncake", "--debug-faults")
    decode = start_server("decode", "--model", str(model), "--transfer", "mooncake", *FAST[:2], "--debug-faults",
                          "--kv-timeout-s", str(KV_TIMEOUT_S), "--abort-grace-s", "1")
    return Pair(prefill, decode, port)


@pytest.fixture(scope="module")
def reference(pair) -> str:
    """The pair's text for BODY before any fault (that PD text equals colocated is tested in test_pd_servers)."""
    p, d = asyncio.run(_both_once(pair, pair.room(BODY)))
    assert p.status_code == d.status_code == 200, (p.text, d.text)
    assert d.json()["usage"]["completion_tokens"] == 8
    return d.json()["choices"][0]["message"]["content"]


async def _both_once(pair: Pair, body: dict) -> tuple[httpx.Response, httpx.Response]:
    async with httpx.AsyncClient(timeout=60) as client:
        return await both(client, pair, body)


async def both(client: httpx.AsyncClient, pair: Pair, body: dict) -> tuple[httpx.Response, httpx.Response]:
    return await asyncio.gather(client.post(f"{pair.prefill.url}/v1/chat/completions", json=body),
                                client.post(f"{pair.decode.url}/v1/chat/completions", json=body))


async def still_serves(pair: Pair, reference: str) -> None:
    wait_blocks_free(pair.prefill, pair.decode)
    async with httpx.AsyncClient(timeout=60) as client:
        p, d = await both(client, pair, pair.room(BODY))
    assert p.status_code == d.status_code == 200, (p.text, d.text)
    assert d.json()["choices"][0]["message"]["content"] == reference
    wait_blocks_free(pair.prefill, pair.decode)
    assert httpx.get(f"{pair.prefill.url}/health", timeout=10).status_code == 200
    assert httpx.get(f"{pair.decode.url}/health", timeout=10).status_code == 200


async def test_a_failed_kv_write_is_a_transfer_error_on_both_sides(pair, reference):
    arm(pair.prefill, "prefill.fail_kv_write")
    body = pair.room(BODY)
    room = body["bootstrap_room"]
    async with httpx.AsyncClient(timeout=60) as client:
        p, d = await both(client, pair, body)
    expected = (f"bootstrap room {room}: KV transfer failed: fault point prefill.fail_kv_write: "
                "the write was dropped, nothing was written")
    assert p.status_code == 502, p.text
    assert error(p)["message"] == expected and error(p)["code"] == "kv_transfer_failed"
    assert d.status_code == 502, d.text
    assert error(d)["message"].endswith(expected) and error(d)["code"] == "peer_failed"
    assert (error(d)["stage"], error(d)["peer_code"], "image_key" in error(d)) == ("decode", "kv_transfer_failed", False)
    wait_blocks_free(pair.prefill, pair.decode)
    await still_serves(pair, reference)


async def test_an_unexpected_exception_is_a_500_naming_it_not_a_transfer_failure(pair, reference):
    arm(pair.prefill, "prefill.crash")
    body = pair.room(BODY)
    room = body["bootstrap_room"]
    async with httpx.AsyncClient(timeout=60) as client:
        p, d = await both(client, pair, body)
    expected = f"bootstrap room {room}: the prefill failed: RuntimeError: fault point prefill.crash on room {room}"
    assert p.status_code == 500, p.text
    assert error(p)["message"] == expected and error(p)["code"] == "internal_error"
    assert "KV transfer failed" not in p.text
    assert d.status_code == 502, d.text
    assert error(d)["message"].endswith(expected)
    assert (error(d)["code"], error(d)["peer_code"]) == ("peer_failed", "internal_error")  # the prefill's own code
    wait_blocks_free(pair.prefill, pair.decode)
    await still_serves(pair, reference)


async def test_ready_later_than_the_decode_waits_is_a_504_and_frees_the_blocks(pair, reference):
    delay_s = KV_TIMEOUT_S + 3
    arm(pair.prefill, "prefill.delay_ready", delay_s=delay_s)
    body = pair.room(BODY)
    async with httpx.AsyncClient(timeout=60) as client:
        started = time.monotonic()
        prefill = asyncio.ensure_future(client.post(f"{pair.prefill.url}/v1/chat/completions", json=body))
        d = await client.post(f"{pair.decode.url}/v1/chat/completions", json=body)
        assert d.status_code == 504, d.text
        assert error(d)["code"] == "room_timeout"
        assert KV_TIMEOUT_S <= time.monotonic() - started < KV_TIMEOUT_S + 2
        p = await asyncio.wait_for(prefill, delay_s + 10)
    assert p.status_code == 502, p.text  # the decode gave up on the room while the prefill slept
    assert "decode aborted" in error(p)["message"]
    wait_blocks_free(pair.prefill, pair.decode, within_s=15)
    await still_serves(pair, reference)


async def test_a_dead_receive_loop_makes_health_a_503_naming_it(start_server, model):
    sick, port = start_prefill(start_server, model, "mooncake", "--debug-faults")
    assert httpx.get(f"{sick.url}/health", timeout=10).status_code == 200
    arm(sick, "prefill.receive_loop_crash")
    info = httpx.get(f"{sick.url}/server_info", timeout=10).json()
    request = KVRequest(room=7, fingerprint=Fingerprint(**info["fingerprint"]), block_ids=[0], prompt_tokens=1,
                        descriptor=b"unused", decode_id="test-decode")
    client = BootstrapClient()
    try:
        await client.request_kv("127.0.0.1", port, request, accept_timeout_s=10)  # the loop wakes on it
        accepted = time.monotonic()
        async with httpx.AsyncClient(timeout=5) as http:
            while (health := await http.get(f"{sick.url}/health")).status_code == 200:
                assert time.monotonic() - accepted < 1.0, "health still 200 a second after the loop died"
                await asyncio.sleep(0.05)
    finally:
        await client.close()
    assert health.status_code == 503
    assert error(health)["code"] == "unhealthy"
    assert ("prefill bootstrap receive loop: RuntimeError: fault point prefill.receive_loop_crash"
            in error(health)["message"])
    assert blocks_used(sick) == 0


async def test_decode_exits_before_asking_for_kv(start_server, model, pair):
    doomed = start_server("decode", "--model", str(model), "--transfer", "mooncake", *FAST[:2], "--debug-faults")
    arm(doomed, "decode.exit_before_request")
    body = pair.room(BODY)
    async with httpx.AsyncClient(timeout=60) as client:
        started = time.monotonic()
        p, d = await asyncio.gather(client.post(f"{pair.prefill.url}/v1/chat/completions", json=body),
                                    client.post(f"{doomed.url}/v1/chat/completions", json=body),
                                    return_exceptions=True)
    assert isinstance(d, httpx.HTTPError)  # the decode process is gone
    assert doomed.proc.wait(timeout=10) == 17
    assert p.status_code == 504 and "partner never arrived within 3 s" in error(p)["message"], p.text
    assert time.monotonic() - started < 10
    wait_blocks_free(pair.prefill)


async def test_a_dead_bootstrap_serve_task_is_reported():
    """The serve task is supervised like the loops: if it ends before close() (here its socket is
    closed under it, as a fatal ZeroMQ error would), the supervisor names it."""
    supervisor = Supervisor()
    fingerprint = Fingerprint(model="m", backend="mooncake", dtype="float32", block_size=16, num_layers=1,
                              num_kv_heads=1, head_dim=8, block_bytes=1024)
    server = BootstrapServer(fingerprint, port=0)
    await server.start()
    try:
        supervisor.watch("prefill bootstrap server", server.serve_task)
        assert supervisor.failures() == {}
        server._sock.close(linger=0)
        await asyncio.wait_for(asyncio.shield(server.serve_task), 5)
        assert supervisor.failures() == {"prefill bootstrap server": "task returned"}
    finally:
        await supervisor.stop()
        await server.close()
