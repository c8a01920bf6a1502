"""The router in colocated mode, as a real process in front of a real colocated server: OpenAI parity
through the official client, the router's own limits and error bodies, image URLs fetched from a
local HTTP server, TCP_NODELAY at both ends, chunks relayed at the pace the stage makes them, a
client that leaves, and startup refusals."""

from __future__ import annotations

import asyncio
import json
import socket
import statistics
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from router.config import RouterConfig
from router.runtime import Router
from router.fleet.breaker import CircuitBreaker
from router.upstream.client import Upstream
from router.fleet.workers import Worker
from router.plan.modes import Target
from process.ports import free_port
from tests.conftest import REPO
from tests.support.router_helpers import arm, ask, data_url, messages, metric, png, wait_metric

pytestmark = pytest.mark.timeout(180)
MAX_IMAGE_BYTES = 200_000


class ImageServer:
    """A real HTTP server on loopback serving test images; ``hits`` counts requests by path."""

    def __init__(self) -> None:
        self.files = {"/img.png": png(64, 48, 1), "/big.png": png(300, 300, 2)}
        self.hits: dict[str, int] = {}
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                outer.hits[self.path] = outer.hits.get(self.path, 0) + 1
                if self.path == "/redirect":
                    self.send_response(302)
                    self.send_header("Location", "/img.png")
                    self.end_headers()
                    return
                if self.path == "/slow.png":
                    time.sleep(3)
                body = outer.files.get(self.path.replace("/slow.png", "/img.png"))
                if body is None:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                try:
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the router gave up first (its deadline or size limit)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def colocated(start_server, tiny_model):
    return start_server("colocated", "--model", str(tiny_model("qwen2_vl")), "--kv-cache-mib", "16", "--debug-faults")


@pytest.fixture(scope="module")
def images():
    server = ImageServer()
    yield server
    server.close()


@pytest.fixture(scope="module")
def router(start_server, colocated, images):
    return start_server("router", "--colocated", colocated.url, "--max-in-flight", "2", "--max-body-mb", "1",
                        "--allowed-image-hosts", f"127.0.0.1:{images.port}", "--max-image-bytes", str(MAX_IMAGE_BYTES),
                        "--image-fetch-timeout-s", "1", "--health-interval-s", "0.5")


# --- OpenAI parity ---------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("n_images", [0, 1, 3])
def test_same_answer_as_the_stage(router, colocated, stream, n_images):
    urls = [data_url(png(32 + 16 * i, 48, 10 + i)) for i in range(n_images)]
    msgs = messages(f"describe {n_images}", urls)
    via_router = ask(router.base_url, msgs, stream)
    direct = ask(colocated.base_url, msgs, stream)
    assert via_router == direct
    assert via_router[1]["completion_tokens"] == 12 and via_router[0]


def test_models_and_health(router, colocated):
    assert httpx.get(f"{router.url}/v1/models").json() == httpx.get(f"{colocated.url}/v1/models").json()
    assert httpx.get(f"{router.url}/health").json() == {"status": "ok", "mode": "colocated"}
    assert metric(router.url, f'epd_router_worker_healthy{{role="colocated",worker="{colocated.url}"}}') == 1.0
    assert metric(router.url, f'epd_router_circuit_state{{role="colocated",worker="{colocated.url}"}}') == 0.0


# --- errors ----------------------------------------------------------------------------------
def test_error_bodies(router, colocated):
    chat = f"{router.url}/v1/chat/completions"
    bad_json = httpx.post(chat, content=b"{not json")
    assert bad_json.status_code == 400 and bad_json.json()["error"]["code"] == "invalid_json"
    assert httpx.post(chat, json=[1]).json()["error"]["message"] == "The request body must be a JSON object."
    missing = httpx.get(f"{router.url}/nope")
    assert missing.status_code == 404
    assert missing.json() == {"error": {"message": "Not Found", "type": "invalid_request_error", "param": None,
                                        "code": "not_found"}}
    assert httpx.get(chat).status_code == 405
    model = httpx.get(f"{colocated.url}/v1/models").json()["data"][0]["id"]
    unknown = httpx.post(chat, json={"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]})
    assert unknown.status_code == 404
    assert unknown.json()["error"] == {"message": f"The model `gpt-9` does not exist; this router serves ['{model}'].",
                                       "type": "invalid_request_error", "param": "model", "code": "model_not_found"}
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}  # the stage's own 400, forwarded
    via_router, direct = httpx.post(chat, json=body), httpx.post(f"{colocated.url}/v1/chat/completions", json=body)
    assert via_router.status_code == direct.status_code == 400 and via_router.json() == direct.json()


@pytest.mark.parametrize("depth", [65, 1000, 100_000])
@pytest.mark.parametrize("field", ["messages", "metadata"])
def test_json_nested_too_deep_is_a_400_and_a_client_error(router, field, depth):
    """Nested past 64 levels, in a field the router reads or one it only forwards: 400 invalid_json
    naming the limit (was 500 RecursionError from 1000 levels), counted as client_error, never as
    aborted; the same pooled connection then serves a normal request."""
    names = [f'epd_router_requests_total{{outcome="{o}"}}' for o in ("client_error", "aborted", "internal_error")]
    before = [metric(router.url, name) for name in names]
    nested = "[" * (depth - 1) + "]" * (depth - 1)  # the body itself is level 1
    others = "" if field == "messages" else '"messages": [{"role": "user", "content": "hi"}], '
    raw = "{" + others + f'"{field}": {nested}' + "}"
    with httpx.Client(base_url=router.url, timeout=30) as client:
        refused = client.post("/v1/chat/completions", content=raw.encode(),
                              headers={"Content-Type": "application/json"})
        assert refused.status_code == 400
        assert refused.json() == {"error": {
            "message": "The request body is nested deeper than 64 levels of JSON arrays and objects.",
            "type": "invalid_request_error", "param": None, "code": "invalid_json"}}
        fine = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                         "max_tokens": 2, "ignore_eos": True})
        assert fine.status_code == 200 and fine.json()["usage"]["completion_tokens"] == 2
    wait_metric(router.url, names[0], before[0] + 1)
    assert [metric(router.url, name) for name in names[1:]] == before[1:]


def test_the_routers_own_4xx_answers_are_client_errors(router):
    """413 (body cap), 404 (model), 400 (not JSON, not an object): each counted as client_error."""
    chat = f"{router.url}/v1/chat/completions"
    name = 'epd_router_requests_total{outcome="client_error"}'
    before = metric(router.url, name)
    answers = [httpx.post(chat, content=b'{"pad": "' + b"x" * (1 << 20) + b'"}'),
               httpx.post(chat, json={"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}),
               httpx.post(chat, content=b"{not json"), httpx.post(chat, json=[1])]
    assert [a.status_code for a in answers] == [413, 404, 400, 400]
    wait_metric(router.url, name, before + 4)


def test_body_cap_from_content_length_and_while_reading(router):
    chat = f"{router.url}/v1/chat/completions"
    big = b'{"messages": [], "pad": "' + b"x" * (1 << 20) + b'"}'
    declared = httpx.post(chat, content=big)
    assert declared.status_code == 413
    assert declared.json()["error"] == {
        "message": f"The request body is {len(big)} bytes; this router accepts at most 1048576 bytes (--max-body-mb).",
        "type": "invalid_request_error", "param": None, "code": "request_too_large"}

    def chunks():  # no Content-Length: chunked, cut off while reading
        for _ in range(40):
            yield b"x" * 65536

    streamed = httpx.post(chat, content=chunks())
    assert streamed.status_code == 413
    assert streamed.json()["error"]["message"] == ("The request body is more than 1048576 bytes; this router accepts "
                                                   "at most 1048576 bytes (--max-body-mb).")


async def test_in_flight_limit_answers_503_with_retry_after(router, colocated):
    rejected = metric(router.url, 'epd_router_requests_total{outcome="rejected"}')
    arm(colocated, "engine.stall", times=40, delay_s=0.05)  # the two held requests take ~1 s
    body = {"messages": [{"role": "user", "content": "hold"}], "max_tokens": 16, "ignore_eos": True, "stream": True}
    async with httpx.AsyncClient(timeout=60) as client:
        async def held() -> tuple[bool, str]:
            async with client.stream("POST", f"{router.url}/v1/chat/completions", json=body) as response:
                lines = [line async for line in response.aiter_lines() if line.startswith("data: ")]
            return lines[-2].endswith('"finish_reason":"length"}]}'), lines[-1]

        holders = [asyncio.ensure_future(held()) for _ in range(2)]
        await asyncio.sleep(0.3)
        refused = await client.post(f"{router.url}/v1/chat/completions", json={**body, "stream": False})
        assert refused.status_code == 503 and refused.headers["Retry-After"] == "1"
        assert refused.json()["error"] == {
            "message": "The router is at its limit of 2 requests in flight (--max-in-flight); retry after 1 s.",
            "type": "server_error", "param": None, "code": "server_overloaded"}
        finished = (True, "data: [DONE]")
        assert await asyncio.gather(*holders) == [finished, finished]
    wait_metric(router.url, 'epd_router_requests_total{outcome="rejected"}', rejected + 1)
    wait_metric(router.url, "epd_router_in_flight_requests", 0.0)


def test_upstream_deadline(start_server, colocated):
    """A stage slower than --upstream-timeout-s: 504 naming it within the deadline, and the request is
    aborted at the stage (the connection closed)."""
    impatient = start_server("router", "--colocated", colocated.url, "--upstream-timeout-s", "1", "--retries", "0")
    aborted = metric(colocated.url, 'epd_requests_total{finish_reason="abort"}')
    arm(colocated, "engine.stall", times=1, delay_s=3.0)
    started = time.monotonic()
    response = httpx.post(f"{impatient.url}/v1/chat/completions", timeout=30,
                          json={"messages": [{"role": "user", "content": "slow"}], "max_tokens": 4})
    assert 1.0 <= time.monotonic() - started < 2.5
    assert response.status_code == 504
    assert response.json()["error"] == {
        "message": f"The colocated stage failed: {colocated.url} did not answer within 1 s (--upstream-timeout-s)",
        "type": "server_error", "param": None, "code": "upstream_timeout", "stage": "colocated"}
    wait_metric(colocated.url, 'epd_requests_total{finish_reason="abort"}', aborted + 1, within_s=10)
    wait_metric(colocated.url, "epd_kv_blocks_used", 0.0, within_s=10)
    impatient.stop()


# --- image URLs ------------------------------------------------------------------------------
def test_allowed_image_url_is_fetched_and_answers_like_its_data_url(router, images):
    direct = ask(router.base_url, messages("what", [data_url(images.files["/img.png"])]), stream=False)
    fetched = ask(router.base_url, messages("what", [images.url("/img.png")]), stream=False)
    assert fetched == direct and images.hits["/img.png"] == 1


@pytest.mark.parametrize("path, host, status, code, message", [
    ("/img.png", "localhost", 400, "image_host_not_allowed", "Image URLs on host 'localhost' are not fetched by this "
     "router; add it to --allowed-image-hosts or send the image as a data: URL."),
    ("/big.png", "127.0.0.1", 413, "image_too_large", "The image is {size} bytes; this router accepts at most "
     f"{MAX_IMAGE_BYTES} bytes per image (--max-image-bytes)."),
    ("/missing.png", "127.0.0.1", 400, "image_fetch_failed", "Fetching the image URL answered HTTP 404."),
    ("/redirect", "127.0.0.1", 400, "image_fetch_failed", "Fetching the image URL answered HTTP 302."),
    ("/slow.png", "127.0.0.1", 400, "image_fetch_failed", "Fetching the image URL took longer than 1 s "
     "(--image-fetch-timeout-s)."),
])
def test_refused_image_urls(router, images, path, host, status, code, message):
    body = {"messages": messages("x", [data_url(images.files["/img.png"]), images.url(path, host)]), "max_tokens": 2}
    hits = sum(images.hits.values())
    started = time.monotonic()
    response = httpx.post(f"{router.url}/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == status
    assert response.json()["error"] == {
        "message": message.format(size=len(images.files["/big.png"])), "type": "invalid_request_error",
        "param": "messages[0].content[1].image_url", "code": code}
    assert time.monotonic() - started < 2.5
    assert sum(images.hits.values()) == hits + (host == "127.0.0.1")  # a host not allowed is never dialed


def test_too_many_images_before_any_fetch(router, images):
    body = {"messages": messages("x", [images.url("/img.png")] * 17)}
    hits = sum(images.hits.values())
    response = httpx.post(f"{router.url}/v1/chat/completions", json=body)
    assert response.status_code == 400 and response.json()["error"]["code"] == "too_many_images"
    assert sum(images.hits.values()) == hits


# --- streaming -------------------------------------------------------------------------------
async def test_tcp_nodelay_on_accepted_and_upstream_connections(colocated):
    """In-process: the router's own routes, server and upstream client, inspected on live loopback connections."""
    from router.app import create_routes
    from router.http import HttpServer, Request, Response, json_response
    from process.ports import bind

    config = RouterConfig(colocated=(colocated.url,))
    routes = create_routes(Router(config))

    async def nodelay(request: Request) -> Response:
        assert request.transport is not None
        sock = request.transport.get_extra_info("socket")
        return json_response(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))

    routes.add("GET", "/accepted-socket-nodelay", nodelay)  # a probe route on the real table, this test only
    port = free_port()
    listening = bind("127.0.0.1", port)
    server = HttpServer(routes, config.max_body_bytes)
    await server.listen(listening)
    upstream = Upstream(config)
    await upstream.start()
    try:
        async with httpx.AsyncClient() as client:
            assert (await client.get(f"http://127.0.0.1:{port}/accepted-socket-nodelay")).json() == 1
        # long enough that the stream is still open when the headers arrive
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 256, "ignore_eos": True, "stream": True}
        worker = Worker(colocated.url, "colocated", CircuitBreaker(3, 10.0))
        response = await upstream.post(Target("colocated", worker, json.dumps(body).encode()))
        sock = response.connection.transport.get_extra_info("socket")  # the hot path's own connection
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
        await upstream.read("colocated", worker, response)
    finally:
        await upstream.close()
        await server.shutdown(1.0)
        listening.close()


def first_text_seconds(client: httpx.Client, url: str) -> float:
    body = {"messages": [{"role": "user", "content": "first"}], "max_tokens": 2, "temperature": 0, "stream": True}
    started = time.perf_counter()
    with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        lines = response.iter_lines()
        for line in lines:
            if '"content":"' in line and '"content":""' not in line:
                elapsed = time.perf_counter() - started
                break
        for _ in lines:  # read to the end: the connection goes back to the pool for the next request
            pass
    return elapsed


def test_first_text_on_kept_alive_connections_costs_no_nagle_delay(router, colocated):
    """A relay that leaves Nagle on and writes the headers apart from the first chunk makes the first chunk
    wait for the client's delayed ACK (~40 ms) on a kept-alive connection. The router adds a few ms."""
    with httpx.Client(timeout=30) as client:
        direct = [first_text_seconds(client, colocated.url) for _ in range(12)]
        routed = [first_text_seconds(client, router.url) for _ in range(12)]
    added = statistics.median(routed) - statistics.median(direct)
    assert added < 0.012, (direct, routed)


async def test_chunks_arrive_at_the_pace_the_stage_makes_them(router, colocated):
    """The same request streamed direct and through the router at once: both ride the same decode steps
    (stalled 60 ms each), so the router's copy of each chunk must trail the direct one by a steady offset."""
    body = {"messages": [{"role": "user", "content": "pace"}], "max_tokens": 10, "temperature": 0,
            "ignore_eos": True, "stream": True}

    async def arrivals(client: httpx.AsyncClient, url: str) -> list[float]:
        times = []
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            async for line in response.aiter_lines():
                if '"content":"' in line and '"content":""' not in line:
                    times.append(time.perf_counter())
        return times

    arm(colocated, "engine.stall", times=30, delay_s=0.06)
    async with httpx.AsyncClient(timeout=60) as client:
        direct, routed = await asyncio.gather(arrivals(client, colocated.url), arrivals(client, router.url))
    assert len(direct) == len(routed) >= 8  # a step whose token completes no text sends no chunk
    gaps = [b - a for a, b in zip(routed, routed[1:])]
    assert min(gaps) > 0.03, gaps  # one chunk per stalled step: nothing was held back and sent in a burst
    lag = [r - d for d, r in zip(direct, routed)][1:]  # the first text follows each one's own prefill step
    # a steady offset: each chunk passed on as it came; one held back a step would move by 60 ms, so
    # half a step is the bound (20 ms failed once on a loaded machine)
    assert max(lag) - min(lag) < 0.03, lag


async def test_client_leaving_mid_stream_aborts_the_request(router, colocated):
    aborted = metric(router.url, 'epd_router_requests_total{outcome="aborted"}')
    body = {"messages": [{"role": "user", "content": "leave"}], "max_tokens": 400, "ignore_eos": True, "stream": True}
    async with httpx.AsyncClient(timeout=60) as client:
        async with client.stream("POST", f"{router.url}/v1/chat/completions", json=body) as response:
            seen = 0
            async for line in response.aiter_lines():
                seen += line.startswith("data: ")
                if seen >= 4:
                    break
    deadline = time.monotonic() + 10
    while metric(colocated.url, "epd_kv_blocks_used") or metric(router.url, "epd_router_in_flight_requests"):
        assert time.monotonic() < deadline, "the stage still holds the abandoned request's blocks"
        await asyncio.sleep(0.1)
    wait_metric(router.url, 'epd_router_requests_total{outcome="aborted"}', aborted + 1)


# --- startup ---------------------------------------------------------------------------------
def run_router(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cli", "serve", "router", "--port", str(free_port()), *flags],
                          cwd=REPO, capture_output=True, text=True, timeout=30)


def test_refuses_to_start_without_an_answering_worker():
    dead = f"http://127.0.0.1:{free_port()}"
    result = run_router("--colocated", dead, "--startup-timeout-s", "1")
    assert result.returncode == 2
    assert f"stage serve router: cannot start: no colocated worker answered within 1 s (--startup-timeout-s): " \
           f"['{dead}']" in result.stderr
    assert "Unclosed" not in result.stderr  # the failed start closed the clients it had opened


def test_refuses_bad_flags():
    assert "pd mode needs both --prefill and --decode workers" in run_router("--prefill", "http://h:1").stderr
    epd = ("--encoder", "http://127.0.0.1:1", "--prefill", "http://127.0.0.1:2", "--decode", "http://127.0.0.1:3")
    for flags, message in ((epd, "epd mode (--encoder given) needs --redis-url, the embedding cache index"),
                           ((*epd, "--redis-url", "http://127.0.0.1:4"),
                            "--redis-url must start with redis://, rediss:// or unix://")):
        result = run_router(*flags)
        assert (result.returncode, result.stderr.strip()) == (2, f"stage serve router: error: {message}")
