"""A stream whose client stops reading, through the router in pd mode in front of the fake pair
(``bench/fake_backend.py``: no model, so the stream can be 64 MiB and fast): the router stops reading
the decode while the client's socket is full (the decode's writes stall: the router holds no more
than its socket buffers), and once the client reads again every event arrives, whole and in order;
the router then serves the next request."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import httpx
import pytest

from process.ports import free_port
from tests.conftest import REPO

pytestmark = pytest.mark.timeout(120)
TOKENS, TOKEN_BYTES = 8000, 8192  # 64 MiB of text: more than every socket buffer on the way holds
STALL_S = 1.5  # the client reads nothing this long


@pytest.fixture(scope="module")
def pair():
    ports = {name: free_port() for name in ("prefill", "decode", "bootstrap")}
    proc = subprocess.Popen([sys.executable, str(REPO / "bench" / "fake_backend.py"),
                             "--prefill-port", str(ports["prefill"]), "--decode-port", str(ports["decode"]),
                             "--bootstrap-port", str(ports["bootstrap"]), "--tokens", str(TOKENS),
                             "--token-bytes", str(TOKEN_BYTES), "--itl-ms", "0"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    urls = {role: f"http://127.0.0.1:{ports[role]}" for role in ("prefill", "decode")}
    deadline = time.monotonic() + 30
    while True:
        try:
            httpx.get(urls["decode"] + "/health", timeout=1).raise_for_status()
            break
        except httpx.HTTPError:
            assert proc.poll() is None and time.monotonic() < deadline, "the fake pair did not start"
            time.sleep(0.1)
    yield urls
    proc.terminate()
    proc.wait(10)


@pytest.fixture(scope="module")
def router(start_server, pair):
    return start_server("router", "--prefill", pair["prefill"], "--decode", pair["decode"])


def written(pair) -> int:
    return httpx.get(pair["decode"] + "/bench/stats", timeout=5).json().get("decode_chunks_written", 0)


def wait_still(pair, within_s: float = 20.0) -> int:
    """The decode's written count once it stopped moving for half a second."""
    deadline = time.monotonic() + within_s
    last = written(pair)
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = written(pair)
        if now == last:
            return now
        last = now
    raise AssertionError(f"the decode kept writing for {within_s} s: nothing held it back")


def read_all(sock: socket.socket, within_s: float = 60.0) -> bytes:
    sock.settimeout(within_s)
    pieces = []
    while piece := sock.recv(1 << 20):
        pieces.append(piece)
    return b"".join(pieces)


def dechunk(body: bytes) -> bytes:
    out, at = [], 0
    while True:
        end = body.index(b"\r\n", at)
        size = int(body[at:end], 16)
        if size == 0:
            return b"".join(out)
        out.append(body[end + 2:end + 2 + size])
        at = end + 2 + size + 2


def test_a_client_that_stops_reading_stalls_the_decode_and_then_gets_every_event(router, pair):
    before = written(pair)
    body = json.dumps({"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "stream": True,
                       "max_tokens": TOKENS}).encode()
    with socket.create_connection(("127.0.0.1", int(router.url.rsplit(":", 1)[1])), timeout=30) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
                     b"Connection: close\r\nContent-Length: %d\r\n\r\n%b" % (len(body), body))
        time.sleep(STALL_S)
        stalled = wait_still(pair) - before
        assert 0 < stalled < TOKENS * 3 // 4, f"{stalled} of {TOKENS} chunks left the decode while the client read nothing"
        raw = read_all(sock)
    head, _, chunked = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    events = [e for e in dechunk(chunked).split(b"\n\n") if e]
    chunks = [json.loads(e[6:]) for e in events if e.startswith(b"data: {")]
    texts = [c["choices"][0]["delta"].get("content") for c in chunks if c["choices"]]
    assert texts.count("a" * TOKEN_BYTES) == TOKENS and events[-1] == b"data: [DONE]"
    assert written(pair) - before == TOKENS
    answer = httpx.post(router.url + "/v1/chat/completions", timeout=30,
                        json={"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]})
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == TOKENS
