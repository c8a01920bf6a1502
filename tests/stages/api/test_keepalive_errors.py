"""An error never costs the next request: on every role (colocated, prefill, decode, encoder, pd, and
the router in its colocated, pd and epd modes), each error status the role gives is followed, on the
same pooled connection, by a normal request that succeeds.

Before: after an unexpected exception Starlette answered 500 and re-raised, and uvicorn reset the
kept-alive connection without ``Connection: close``; a pooled client's next request died with
ECONNRESET. Each role here gets one ``httpx.Client`` limited to one connection, and every answer
must come over the same local port (the connection was reused, never silently replaced)."""

from __future__ import annotations

import base64
import random
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx
import pytest

from process.ports import free_port
from tests.conftest import ServerProcess, launch
from tests.support.devices import DEVICE
from tests.support.epd_helpers import png
from tests.support.redis_fixtures import redis_server  # noqa: F401
from tests.support.router_helpers import arm

pytestmark = pytest.mark.timeout(400)
TOKEN = "keepalive-admin-token-0123456789"
BODY_MB = 1
TOO_LARGE = b'{"messages": "' + b"x" * (BODY_MB << 20) + b'"}'
STALL_S = 3.0  # the filler request holds the only slot this long
JSON = {"content-type": "application/json"}
HELLO = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2, "temperature": 0}


@dataclass
class Pooled:
    """One pooled connection to one server, and the local port of every answer it carried."""

    url: str
    client: httpx.Client = field(init=False)
    ports: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.client = httpx.Client(base_url=self.url, timeout=60,
                                   limits=httpx.Limits(max_connections=1, max_keepalive_connections=1))

    def send(self, method: str, path: str, **kwargs) -> httpx.Response:
        response = self.client.request(method, path, **kwargs)
        self.ports.add(response.extensions["network_stream"].get_extra_info("client_addr")[1])
        return response


@pytest.fixture(scope="module")
def servers(tiny_model, redis_server, tmp_path_factory) -> Iterator[dict[str, ServerProcess]]:  # noqa: F811
    """Every role, started in parallel: colocated, PD prefill and decode, a switchable pd worker, an
    encoder with EPD prefill and decode, and a router in each mode."""
    model, logs = str(tiny_model("qwen2_vl")), tmp_path_factory.mktemp("keepalive-logs")
    common = ["--model", model, "--device", DEVICE, "--kv-cache-mib", "16", "--max-body-mb", str(BODY_MB)]
    epd = ["--redis-url", redis_server.url]
    bootstrap, epd_bootstrap = free_port(), free_port()
    stages = {
        "colocated": ("colocated", [*common, "--debug-faults", "--max-num-seqs", "1", "--max-waiting", "0"]),
        "prefill": ("prefill", [*common, "--debug-faults", "--bootstrap-port", str(bootstrap)]),
        "decode": ("decode", [*common, "--debug-faults"]),
        "pd": ("pd", [*common, "--bootstrap-port", str(free_port()), "--admin-token", TOKEN]),
        "encoder": ("encoder", ["--model", model, "--device", DEVICE, "--max-body-mb", str(BODY_MB), "--debug-faults",
                                *epd]),
        "epd_prefill": ("prefill", [*common, *epd, "--bootstrap-port", str(epd_bootstrap)]),
        "epd_decode": ("decode", [*common, *epd]),
    }
    started: dict[str, ServerProcess] = {}
    try:
        with ThreadPoolExecutor(len(stages)) as pool:
            jobs = {name: pool.submit(launch, role, flags, logs / f"{name}.log", 240.0)
                    for name, (role, flags) in stages.items()}
            for name, job in jobs.items():
                started[name] = job.result()
        s = started
        routers = {
            "router_colocated": ["--colocated", s["colocated"].url, "--max-in-flight", "1"],
            "router_pd": ["--prefill", s["prefill"].url, "--decode", s["decode"].url, "--admin-token", TOKEN],
            "router_epd": ["--encoder", s["encoder"].url, "--prefill", s["epd_prefill"].url,
                           "--decode", s["epd_decode"].url, "--redis-url", redis_server.url],
        }
        with ThreadPoolExecutor(len(routers)) as pool:
            jobs = {name: pool.submit(launch, "router", [*flags, "--max-body-mb", str(BODY_MB)],
                                      logs / f"{name}.log", 60.0) for name, flags in routers.items()}
            for name, job in jobs.items():
                started[name] = job.result()
        yield started
    finally:
        for server in started.values():
            server.stop()


# --- what each role gets wrong, and its normal request ------------------------------------------
def bad_json(conn: Pooled, path: str = "/v1/chat/completions") -> httpx.Response:
    return conn.send("POST", path, content=b'{"messages": [', headers=JSON)


def too_large(conn: Pooled, path: str = "/v1/chat/completions") -> httpx.Response:
    return conn.send("POST", path, content=TOO_LARGE, headers=JSON)


def common_errors(path: str) -> list[tuple[str, Callable[[Pooled], httpx.Response], int, str | None]]:
    """400, 404 (unknown path), 405 (GET on a POST route) and 413: every role answers these."""
    return [("bad json", lambda c: bad_json(c, path), 400, "invalid_json"),
            ("unknown path", lambda c: c.send("GET", "/no/such/path"), 404, "not_found"),
            ("wrong method", lambda c: c.send("GET", path), 405, "method_not_allowed"),
            ("too large", lambda c: too_large(c, path), 413, "request_too_large")]


def crash(server: ServerProcess) -> Callable[[Pooled], httpx.Response]:
    """A 500 from an unexpected exception (fault point ``http.crash``) in the chat route."""
    def send(conn: Pooled) -> httpx.Response:
        arm(server, "http.crash", 1)
        return conn.send("POST", "/v1/chat/completions", json=HELLO)
    return send


def slot_taken(server: ServerProcess, within_s: float = 10.0) -> None:
    """Wait until ``server``'s only slot is held: admission is decided before the body is read, so a
    body that is not JSON gets 503 while the slot is taken and 400 at once (no engine work) while free."""
    deadline = time.monotonic() + within_s
    while httpx.post(f"{server.url}/v1/chat/completions", content=b"{", timeout=10).status_code != 503:
        assert time.monotonic() < deadline, f"the other request did not take the slot within {within_s} s"
        time.sleep(0.01)


def overloaded(server: ServerProcess, through: str, attempts: int = 3) -> Callable[[Pooled], httpx.Response]:
    """A 503: another client's request holds the only slot (the engine stalls), then ours arrives once
    the slot is seen taken. If ours still got there first (the stall ended before it arrived), the
    race is run again, a bounded number of times; each of our 200s is itself a normal request on the
    same connection."""
    def send(conn: Pooled) -> httpx.Response:
        for _ in range(attempts):
            arm(server, "engine.stall", 1, STALL_S)
            with ThreadPoolExecutor(1) as pool, httpx.Client(timeout=60) as other:
                held = pool.submit(other.post, f"{through}/v1/chat/completions", json=HELLO)
                slot_taken(server)
                response = conn.send("POST", "/v1/chat/completions", json=HELLO)
                statuses = sorted([response.status_code, held.result(timeout=60).status_code])
            assert statuses == [200, 503], statuses
            if response.status_code == 503:
                return response
        raise AssertionError(f"our request reached the slot first {attempts} times in a row")
    return send


def check(conn: Pooled, cases, normal: Callable[[Pooled], None]) -> None:
    for name, send, status, code in cases:
        response = send(conn)
        assert response.status_code == status, (name, response.text)
        error = response.json()["error"]
        assert code is None or error["code"] == code, (name, error)
        assert {"message", "type", "param", "code"} <= set(error), (name, error)  # typed fields may follow
        normal(conn)
    assert len(conn.ports) == 1, f"the connection was replaced: local ports {sorted(conn.ports)}"


def chat_ok(conn: Pooled, body: dict = HELLO) -> None:
    response = conn.send("POST", "/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["role"] == "assistant"


# --- the stages ---------------------------------------------------------------------------------
def test_colocated(servers):
    server = servers["colocated"]
    cases = [*common_errors("/v1/chat/completions"),
             ("wrong model", lambda c: c.send("POST", "/v1/chat/completions", json={**HELLO, "model": "nope"}),
              404, "model_not_found"),
             ("crash", crash(server), 500, "internal_error"),
             ("overloaded", overloaded(server, server.url), 503, "server_overloaded")]
    with Pooled(server.url).client:
        check(Pooled(server.url), cases, chat_ok)


def test_prefill_and_decode(servers):
    prefill, decode = servers["prefill"], servers["decode"]
    bootstrap = httpx.get(f"{prefill.url}/server_info", timeout=10).json()["bootstrap"]["port"]
    p_conn, d_conn = Pooled(prefill.url), Pooled(decode.url)

    def pair_ok(_: Pooled) -> None:
        body = {**HELLO, "bootstrap_host": "127.0.0.1", "bootstrap_port": bootstrap,
                "bootstrap_room": random.getrandbits(63)}
        with ThreadPoolExecutor(2) as pool:
            answers = list(pool.map(lambda c: c.send("POST", "/v1/chat/completions", json=body), (p_conn, d_conn)))
        assert [a.status_code for a in answers] == [200, 200], [a.text for a in answers]

    admin = [("admin disabled", lambda c: c.send("POST", "/admin/allowed_bootstrap", json={}), 403, None)]
    check(p_conn, [*common_errors("/v1/chat/completions"), ("crash", crash(prefill), 500, "internal_error")], pair_ok)
    check(d_conn, [*common_errors("/v1/chat/completions"), ("crash", crash(decode), 500, "internal_error"), *admin],
          pair_ok)
    assert len(p_conn.ports) == len(d_conn.ports) == 1


def test_encoder(servers):
    image = base64.b64encode(png(32, 32, 1)).decode()
    rooms = iter(range(1, 1000))

    def encode_ok(conn: Pooled) -> None:
        response = conn.send("POST", "/v1/encode", json={"room": next(rooms), "images": [{"data": image}]})
        assert response.status_code == 200, response.text
        assert response.json()["images"][0]["status"] in ("encoded", "cached")

    def encode_crash(conn: Pooled) -> httpx.Response:
        arm(servers["encoder"], "http.crash", 1)
        return conn.send("POST", "/v1/encode", json={"room": next(rooms), "images": [{"data": image}]})

    conn = Pooled(servers["encoder"].url)
    check(conn, [*common_errors("/v1/encode"), ("crash", encode_crash, 500, "internal_error")], encode_ok)


def test_switchable_pd_worker(servers):
    def info_ok(conn: Pooled) -> None:
        assert conn.send("GET", "/server_info").status_code == 200

    cases = [*common_errors("/v1/chat/completions")[1:3],
             ("no role yet", lambda c: c.send("POST", "/v1/chat/completions", json=HELLO), 503, "no_role"),
             ("no token", lambda c: c.send("POST", "/role", json={"role": "decode"}), 401, "unauthorized"),
             ("bad json", lambda c: c.send("POST", "/role", content=b"{", headers={"authorization": f"Bearer {TOKEN}"}),
              400, "invalid_json")]
    check(Pooled(servers["pd"].url), cases, info_ok)


# --- the router, in each mode -------------------------------------------------------------------
def test_router_colocated(servers):
    router, colocated = servers["router_colocated"], servers["colocated"]
    cases = [*common_errors("/v1/chat/completions"),
             ("wrong model", lambda c: c.send("POST", "/v1/chat/completions", json={**HELLO, "model": "nope"}),
              404, "model_not_found"),
             ("admin disabled", lambda c: c.send("GET", "/admin/workers"), 403, None),
             ("stage crashed", crash_behind(colocated), 500, "internal_error"),
             ("overloaded", overloaded(colocated, router.url), 503, "server_overloaded")]
    check(Pooled(router.url), cases, chat_ok)


def crash_behind(server: ServerProcess) -> Callable[[Pooled], httpx.Response]:
    """The stage behind the router crashes on this request: the router answers with an error of its own."""
    def send(conn: Pooled) -> httpx.Response:
        arm(server, "http.crash", 1)
        return conn.send("POST", "/v1/chat/completions", json=HELLO)
    return send


def test_router_pd(servers):
    cases = [*common_errors("/v1/chat/completions"),
             ("wrong token", lambda c: c.send("GET", "/admin/workers", headers={"authorization": "Bearer x"}),
              401, None),
             ("prefill crashed", crash_behind(servers["prefill"]), 500, "internal_error")]
    check(Pooled(servers["router_pd"].url), cases, chat_ok)


def test_router_epd(servers):
    image = "data:image/png;base64," + base64.b64encode(png(32, 32, 2)).decode()
    with_image = {**HELLO, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": "what is it?"}]}]}
    cases = [*common_errors("/v1/chat/completions"),
             ("admin disabled", lambda c: c.send("GET", "/admin/workers"), 403, None),
             ("encoder crashed", crash_encode_behind(servers["encoder"], with_image), 500, "internal_error")]
    check(Pooled(servers["router_epd"].url), cases, lambda c: chat_ok(c, with_image))


def crash_encode_behind(encoder: ServerProcess, body: dict) -> Callable[[Pooled], httpx.Response]:
    def send(conn: Pooled) -> httpx.Response:
        arm(encoder, "http.crash", 1)
        fresh = png(40, 24, random.getrandbits(16))  # not cached: the router must send it to the encoder
        url = "data:image/png;base64," + base64.b64encode(fresh).decode()
        parts = [{"type": "image_url", "image_url": {"url": url}}, body["messages"][0]["content"][1]]
        return conn.send("POST", "/v1/chat/completions",
                         json={**body, "messages": [{"role": "user", "content": parts}]})
    return send
