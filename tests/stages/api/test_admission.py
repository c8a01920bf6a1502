"""Body and admission limits on a real colocated server: a body over ``--max-body-mb`` gets 413 without
the server reading it (from Content-Length, or while a chunked body streams in), and a burst far
beyond ``--max-num-seqs`` + ``--max-waiting`` gets only 200s and 503s with Retry-After, while the
server's memory stays put and every count goes back to zero."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections import Counter

import httpx
import pytest

pytestmark = pytest.mark.timeout(180)
MAX_BODY_MB = 1
MAX_NUM_SEQS, MAX_WAITING = 4, 32
BURST = 300
RSS_GROWTH_MIB = 150
CHAT = {"messages": [{"role": "user", "content": "Count to ten."}], "max_tokens": 8, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(start_server, tiny_model):
    return start_server("colocated", "--model", str(tiny_model("qwen2_vl")), "--kv-cache-mib", "16",
                        "--max-model-len", "256", "--max-body-mb", str(MAX_BODY_MB),
                        "--max-num-seqs", str(MAX_NUM_SEQS), "--max-waiting", str(MAX_WAITING))


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def gauges(server) -> dict[str, float]:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    names = ("epd_running_requests", "epd_queue_depth", "epd_kv_blocks_used")
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line.split(" ")[0] in names}


def raw_response(sock: socket.socket, within_s: float) -> tuple[int, dict[str, str], dict]:
    """Read one HTTP/1.1 response (status, headers, JSON body) from ``sock`` within ``within_s``."""
    sock.settimeout(within_s)
    deadline = time.monotonic() + within_s
    data = b""
    while b"\r\n\r\n" not in data or len(data) < _expected_length(data):
        assert time.monotonic() < deadline, f"no full response within {within_s} s: {data!r}"
        chunk = sock.recv(65536)
        assert chunk, f"the server closed the connection mid-response: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode().split("\r\n")
    headers = {name.lower(): value.strip() for name, _, value in (h.partition(":") for h in header_lines)}
    return int(status_line.split()[1]), headers, json.loads(body)


def _expected_length(data: bytes) -> int:
    head, _, _ = data.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(head) + 4 + int(value)
    return len(data) + 1  # no length yet: keep reading


def post_head(server, *headers: str) -> bytes:
    lines = ["POST /v1/chat/completions HTTP/1.1", f"Host: 127.0.0.1:{server.port}",
             "Content-Type: application/json", *headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def assert_too_large(status: int, headers: dict, body: dict, fragment: str) -> None:
    assert status == 413, body
    assert headers["content-type"] == "application/json"
    error = body["error"]
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", None, "request_too_large")
    assert fragment in error["message"] and "--max-body-mb" in error["message"], error["message"]


def test_a_declared_gigabyte_is_refused_before_it_is_read(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
        sock.sendall(post_head(server, f"Content-Length: {1 << 30}") + b"{" + b" " * 4095)
        started = time.monotonic()
        status, headers, body = raw_response(sock, within_s=1.0)
    assert time.monotonic() - started < 1.0
    assert_too_large(status, headers, body, f"is {1 << 30} bytes; this server accepts at most {MAX_BODY_MB << 20}")


def test_a_chunked_body_is_cut_off_once_it_runs_over(server):
    """No Content-Length: the cap is enforced while reading. The test sends the cap plus 64 KiB and
    never ends the body; the server must answer without waiting for the rest."""
    piece = b" " * (64 << 10)
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
        sock.sendall(post_head(server, "Transfer-Encoding: chunked"))
        for _ in range((MAX_BODY_MB << 20) // len(piece) + 1):
            sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
        status, headers, body = raw_response(sock, within_s=5.0)
    assert_too_large(status, headers, body, f"more than {MAX_BODY_MB << 20}")


def test_the_server_still_serves_after_oversized_bodies(server):
    response = httpx.post(f"{server.url}/v1/chat/completions", json=CHAT, timeout=30)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 8


async def burst(server, count: int) -> list[httpx.Response]:
    limits = httpx.Limits(max_connections=count, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=server.url, limits=limits, timeout=60) as client:
        return await asyncio.gather(*(client.post("/v1/chat/completions", json=CHAT) for _ in range(count)))


def test_a_burst_beyond_the_queue_gets_only_200s_and_503s(server):
    assert httpx.post(f"{server.url}/v1/chat/completions", json=CHAT, timeout=30).status_code == 200  # warm
    before = rss_mib(server.proc.pid)
    for _ in range(2):  # the second round shows nothing accumulates across rounds
        responses = asyncio.run(asyncio.wait_for(burst(server, BURST), timeout=120))
        statuses = Counter(r.status_code for r in responses)
        assert set(statuses) == {200, 503}, statuses
        # a 503 means MAX_NUM_SEQS + MAX_WAITING were in flight then, and each of those ends in a 200
        assert statuses[200] >= MAX_NUM_SEQS + MAX_WAITING, statuses
        for response in responses:
            if response.status_code == 503:
                assert response.headers["retry-after"] == "1"
                error = response.json()["error"]
                assert (error["type"], error["code"]) == ("server_error", "server_overloaded")
                assert f"limit of {MAX_NUM_SEQS + MAX_WAITING} requests in flight" in error["message"]
            else:
                assert response.json()["usage"]["completion_tokens"] == 8
    assert rss_mib(server.proc.pid) - before < RSS_GROWTH_MIB
    deadline = time.monotonic() + 10
    while any(gauges(server).values()):
        assert time.monotonic() < deadline, gauges(server)
        time.sleep(0.1)
    assert httpx.get(f"{server.url}/health", timeout=10).json() == {"status": "ok"}
