"""The router's admin API against real stage servers over Mooncake: a prefill (group a), a decode
(group a), two switchable `stage serve pd` workers (one assigned prefill, one decode by the router at
startup), and a decode added at runtime (group b, whose --allowed-bootstrap excludes loopback, so
the router must register the prefills with it). Tests run in file order and leave the pool serving.

Token rules, workers added, drained and removed at runtime, pairing rules under concurrent load, P<->D
role switches under 8 concurrent streams with exact greedy text, room timelines from every stage,
the ratio recommendation on encode-heavy vs decode-heavy load, and the `stage admin` CLI."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable

import httpx
import openai
import pytest
from aiohttp import web

from process.ports import free_port
from tests.conftest import REPO
from tests.support.router_helpers import ask, data_url, messages, metric, png, wait_metric

pytestmark = pytest.mark.timeout(300)
TOKEN = "admin-token-for-tests-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
FAST = ["--kv-cache-mib", "16", "--transfer", "mooncake", "--pair-timeout-s", "5", "--transfer-timeout-s", "5"]
DECODE = ["--kv-timeout-s", "10", "--abort-grace-s", "1"]
LENGTH = 'epd_requests_total{finish_reason="length"}'


@pytest.fixture(scope="module")
def model(tiny_model):
    return str(tiny_model("qwen2_vl"))


@pytest.fixture(scope="module")
def prefill(start_server, model):
    return start_server("prefill", "--model", model, *FAST, "--bootstrap-port", str(free_port()), "--group", "a")


@pytest.fixture(scope="module")
def decode(start_server, model):
    return start_server("decode", "--model", model, *FAST, *DECODE, "--group", "a", "--admin-token", TOKEN)


@pytest.fixture(scope="module")
def switchables(start_server, model):
    return [start_server("pd", "--model", model, *FAST, *DECODE, "--bootstrap-port", str(free_port()),
                         "--admin-token", TOKEN) for _ in range(2)]


@pytest.fixture(scope="module")
def late_decode(start_server, model):
    """Started now, added to the router by a test; allows no loopback prefill on its own."""
    return start_server("decode", "--model", model, *FAST, *DECODE, "--group", "b", "--admin-token", TOKEN,
                        "--allowed-bootstrap", "10.0.0.0/8")


@pytest.fixture(scope="module")
def router(start_server, prefill, decode, switchables):
    x1, x2 = switchables
    return start_server("router", "--prefill", prefill.url, "--prefill", x1.url, "--decode", decode.url,
                        "--decode", x2.url, "--admin-token", TOKEN, "--health-interval-s", "0.5",
                        "--upstream-timeout-s", "60", "--ratio-window-s", "60", "--drain-timeout-s", "60")


def admin(router, method: str, path: str, **kwargs) -> httpx.Response:
    return httpx.request(method, f"{router.url}/admin{path}", headers=AUTH, timeout=120, **kwargs)


def workers(router) -> dict[str, dict]:
    """The admin listing by URL."""
    response = admin(router, "GET", "/workers")
    assert response.status_code == 200, response.text
    return {w["url"]: w for w in response.json()["workers"]}


def rooms_since(router, started: float) -> list[dict]:
    rooms = admin(router, "GET", "/rooms?slowest=1024").json()["rooms"]
    return [r for r in rooms if r["events"][0]["t"] >= started]


def text_body(i: int, max_tokens: int) -> dict:
    return {"messages": messages(f"admin {i}: " + "word " * (i % 4), []), "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True}


async def stream(client: httpx.AsyncClient, url: str, body: dict) -> str:
    """The streamed text of one request; raises on any error event or missing [DONE]."""
    text, done = "", False
    async with client.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                event = httpx.Response(200, content=line[6:]).json()
                assert "error" not in event, event
                text += event["choices"][0]["delta"].get("content") or "" if event["choices"] else ""
    assert done
    return text


# --- auth --------------------------------------------------------------------------------------
def test_admin_needs_the_token(router, start_server, prefill, decode, switchables):
    for headers, message in [({}, "missing admin token: send Authorization: Bearer <token>"),
                             ({"Authorization": "Bearer nope"}, "wrong admin token"),
                             ({"Authorization": TOKEN}, "missing admin token: send Authorization: Bearer <token>")]:
        for method, path in [("GET", "/admin/workers"), ("POST", "/admin/workers"), ("PUT", "/admin/pairing"),
                             ("POST", "/admin/ratio"), ("GET", "/admin/rooms/1"), ("DELETE", "/admin/workers/w1")]:
            response = httpx.request(method, router.url + path, headers=headers, json={}, timeout=10)
            assert response.status_code == 401, (method, path, response.text)
            assert response.json()["error"] == {"message": message, "type": "invalid_request_error", "param": None,
                                                "code": "unauthorized"}
            assert response.headers["WWW-Authenticate"] == "Bearer"
    assert admin(router, "GET", "/workers").status_code == 200
    # the OpenAI routes need none
    assert ask(router.base_url, messages("no token here", []), stream=False)[1]["completion_tokens"] == 12
    # a router started without a token never answers open
    closed = start_server("router", "--prefill", prefill.url, "--decode", decode.url)
    for headers in ({}, AUTH):
        response = httpx.get(f"{closed.url}/admin/workers", headers=headers, timeout=10)
        assert response.status_code == 403
        assert response.json()["error"]["message"] == (
            "admin API disabled: start the router with --admin-token or the EPD_ADMIN_TOKEN environment variable "
            "(stage up takes the same flag and variable)")
    # the stages' admin routes follow the same rule
    response = httpx.post(f"{switchables[0].url}/role", json={"role": "decode"}, timeout=10,
                          headers={"Authorization": "Bearer nope"})
    assert (response.status_code, response.json()["error"]["message"]) == (401, "wrong admin token")
    response = httpx.post(f"{decode.url}/admin/allowed_bootstrap", json={"host": "10.1.1.1", "port": 1}, timeout=10)
    assert response.status_code == 401


# --- workers -----------------------------------------------------------------------------------
def test_workers_are_listed_with_their_load(router, prefill, decode, switchables):
    x1, x2 = switchables
    listing = workers(router)
    assert [(w["id"], w["role"], w["group"], w["switchable"]) for w in listing.values()] == [
        ("w1", "prefill", "a", False), ("w2", "prefill", None, True), ("w3", "decode", "a", False),
        ("w4", "decode", None, True)]
    assert [listing[s.url]["id"] for s in (prefill, x1, decode, x2)] == ["w1", "w2", "w3", "w4"]
    for w in listing.values():
        assert (w["healthy"], w["circuit"], w["outstanding"], w["draining"]) == (True, "closed", 0, False)
        assert (w["queue_depth"], w["running"], w["kv_blocks_used"]) == (0.0, 0.0, 0.0)
    assert httpx.get(f"{x1.url}/server_info", timeout=10).json()["role"] == "prefill"  # assigned at startup
    assert httpx.get(f"{x2.url}/server_info", timeout=10).json()["role"] == "decode"


def test_a_misfit_worker_is_refused_with_the_reason(router, prefill, late_decode):
    before = workers(router)
    for body, status, message in [
        ({"url": prefill.url, "role": "prefill"}, 409, f"{prefill.url} is already worker w1 (prefill)"),
        ({"url": late_decode.url, "role": "prefill"}, 409,
         f"{late_decode.url} is a 'decode' server, given as --prefill"),
        ({"url": late_decode.url, "role": "encoder"}, 400,
         "this router runs pd mode: it takes prefill, decode workers, not 'encoder'"),
        ({"url": "http://127.0.0.1:1", "role": "decode"}, 502, "could not reach http://127.0.0.1:1: "),
        ({"url": "http://127.0.0.1:80/v1", "role": "decode"}, 400,
         "url must be http://host:port (no path), got 'http://127.0.0.1:80/v1'"),
        ({"url": late_decode.url}, 400,
         'adding a worker takes {"url": "http://host:port", "role": ROLE, "group"?: LABEL}'),
    ]:
        response = admin(router, "POST", "/workers", json=body)
        assert response.status_code == status, response.text
        assert response.json()["error"]["message"].startswith(message), response.text
    assert workers(router) == before


def test_a_decode_added_at_runtime_takes_traffic(router, prefill, switchables, late_decode):
    response = admin(router, "POST", "/workers", json={"url": late_decode.url, "role": "decode", "group": "b"})
    assert response.status_code == 200, response.text
    added = response.json()
    assert (added["worker"]["id"], added["worker"]["role"], added["worker"]["group"]) == ("w5", "decode", "b")
    # its --allowed-bootstrap excludes loopback: the router registered both prefills with it
    assert added["dial"] == {"w1 -> w5": "registered", "w2 -> w5": "registered"}
    allowed = httpx.get(f"{late_decode.url}/server_info", timeout=10).json()["peer_links"]["allowed"]
    listing = workers(router)
    assert allowed == ["10.0.0.0/8", *(listing[url]["bootstrap"] for url in (prefill.url, switchables[0].url))]
    served = metric(late_decode.url, LENGTH)
    for i in range(6):  # least load, ties in turn: every decode gets some
        assert ask(router.base_url, messages(f"runtime {i}", []), stream=i % 2 == 1, max_tokens=4)[1][
            "completion_tokens"] == 4
    assert metric(late_decode.url, LENGTH) >= served + 1


# --- pairing -----------------------------------------------------------------------------------
async def test_a_pairing_rule_is_honored_under_16_concurrent_requests(router, prefill, decode, switchables,
                                                                      late_decode):
    x1, x2 = switchables
    ids = {w["url"]: w["id"] for w in workers(router).values()}
    rules = {"by": "group", "links": {"a": ["a"], "default": ["b"]}}  # prefill a -> decode a; x1 -> late decode
    response = admin(router, "PUT", "/pairing", json=rules)
    assert response.status_code == 200, response.text
    view = response.json()
    assert view["rules"] == rules and view["allowed_pairs"] == 2
    assert {(p["prefill"], p["decode"]) for p in view["pairs"] if p["allowed"]} == {
        (ids[prefill.url], ids[decode.url]), (ids[x1.url], ids[late_decode.url])}
    unused = metric(x2.url, LENGTH)
    started = time.time()
    async with httpx.AsyncClient(timeout=60) as client:
        answers = await asyncio.wait_for(asyncio.gather(*(
            client.post(f"{router.url}/v1/chat/completions", json=text_body(i, 4)) for i in range(16))), 120)
    assert [a.status_code for a in answers] == [200] * 16
    pairs = {(r["workers"]["prefill"]["id"], r["workers"]["decode"]["id"]) for r in rooms_since(router, started)}
    assert pairs <= {(ids[prefill.url], ids[decode.url]), (ids[x1.url], ids[late_decode.url])} and pairs
    assert len(rooms_since(router, started)) == 16
    assert metric(x2.url, LENGTH) == unused
    # rules that allow no pair: a clear 503
    assert admin(router, "PUT", "/pairing", json={"by": "group", "links": {"a": [], "default": []}}).json()[
        "allowed_pairs"] == 0
    response = httpx.post(f"{router.url}/v1/chat/completions", json=text_body(0, 2), timeout=30)
    assert response.status_code == 503 and response.headers["Retry-After"] == "1"
    assert response.json()["error"]["code"] == "no_allowed_pair"
    assert response.json()["error"]["message"] == (
        "No healthy prefill and decode pair is allowed by the pairing rules (by group (links: a -> nothing; "
        "default -> nothing)); change them with PUT /admin/pairing or add workers.")
    bad = admin(router, "PUT", "/pairing", json={"by": "rack"})
    assert (bad.status_code, bad.json()["error"]["code"]) == (400, "invalid_pairing")
    assert admin(router, "PUT", "/pairing", json={"by": "any"}).json()["allowed_pairs"] == 6


# --- drain and remove --------------------------------------------------------------------------
async def busy_decode(router, client: httpx.AsyncClient, max_tokens: int) -> tuple[asyncio.Task, dict]:
    """Start a long stream; its task and the decode serving it (the one with a request in flight)."""
    task = asyncio.ensure_future(stream(client, router.url, text_body(99, max_tokens)))
    deadline = time.monotonic() + 30
    while not (busy := [w for w in workers(router).values() if w["role"] == "decode" and w["outstanding"]]):
        assert time.monotonic() < deadline and not task.done(), "the stream never started"
        await asyncio.sleep(0.05)
    return task, busy[0]


async def test_a_drained_worker_finishes_its_stream_and_gets_no_new_request(router):
    async with httpx.AsyncClient(timeout=120) as client:
        task, busy = await busy_decode(router, client, max_tokens=1500)
        served = metric(busy["url"], LENGTH)
        response = admin(router, "POST", f"/workers/{busy['id']}/drain?wait_s=0")
        assert response.status_code == 202, response.text
        assert (response.json()["idle"], response.json()["worker"]["draining"],
                response.json()["worker"]["outstanding"]) == (False, True, 1)
        for i in range(4):
            assert ask(router.base_url, messages(f"while draining {i}", []), stream=False, max_tokens=3)[1][
                "completion_tokens"] == 3
        assert not task.done()  # the drained worker is still streaming
        assert len(await asyncio.wait_for(task, 120)) > 0
    response = admin(router, "POST", f"/workers/{busy['id']}/drain")  # waits until idle
    assert response.status_code == 200 and response.json()["idle"] is True
    assert metric(busy["url"], LENGTH) == served + 1  # only the stream it had
    assert admin(router, "POST", f"/workers/{busy['id']}/resume").json()["worker"]["draining"] is False
    assert admin(router, "POST", "/workers/w99/drain").status_code == 404


async def test_removing_a_busy_worker_is_refused(router, late_decode):
    async with httpx.AsyncClient(timeout=120) as client:
        task, busy = await busy_decode(router, client, max_tokens=1500)
        response = admin(router, "DELETE", f"/workers/{busy['id']}")
        assert response.status_code == 409
        assert response.json()["error"]["message"] == (
            f"{busy['id']} (decode {busy['url']}) has 1 request(s) in flight: drain it first (POST "
            f"/admin/workers/{busy['id']}/drain) or remove it with ?force=true")
        assert busy["url"] in workers(router)
        await asyncio.wait_for(task, 120)
    late = workers(router)[late_decode.url]
    response = admin(router, "DELETE", f"/workers/{late['id']}")
    assert response.status_code == 200 and response.json()["removed"]["id"] == late["id"]
    assert late_decode.url not in workers(router)
    assert ask(router.base_url, messages("after removal", []), stream=True, max_tokens=3)[1]["completion_tokens"] == 3


# --- role switch -------------------------------------------------------------------------------
async def test_a_role_switch_under_8_concurrent_streams_loses_nothing(router, prefill, decode, switchables):
    x1, x2 = switchables
    ids = {w["url"]: w["id"] for w in workers(router).values()}
    bodies = [text_body(i, 24) for i in range(8)]
    async with httpx.AsyncClient(timeout=120) as client:
        expected = [await stream(client, router.url, body) for body in bodies]
        failures = {name: metric(router.url, name) for name in (
            'epd_router_requests_total{outcome="upstream_error"}', 'epd_router_retries_total{stage="prefill"}',
            'epd_router_retries_total{stage="decode"}')}
        stop, rounds = asyncio.Event(), []

        async def load() -> None:
            deadline = time.monotonic() + 150
            while not stop.is_set() and time.monotonic() < deadline:
                rounds.append(await asyncio.gather(*(stream(client, router.url, b) for b in bodies),
                                                   return_exceptions=True))

        loader = asyncio.ensure_future(load())
        await asyncio.sleep(0.3)
        first = await client.post(f"{router.url}/admin/ratio", json={"prefill": 1, "decode": 3}, headers=AUTH)
        between = time.time()
        await asyncio.sleep(1.0)
        second = await client.post(f"{router.url}/admin/ratio", json={"prefill": 3, "decode": 1}, headers=AUTH)
        after = time.time()
        await asyncio.sleep(0.5)
        stop.set()
        await asyncio.wait_for(loader, 150)
    assert first.status_code == 200, first.text
    assert [(s["id"], s["from"], s["to"]) for s in first.json()["switched"]] == [(ids[x1.url], "prefill", "decode")]
    assert second.status_code == 200, second.text
    assert sorted((s["id"], s["from"], s["to"]) for s in second.json()["switched"]) == [
        (ids[x1.url], "decode", "prefill"), (ids[x2.url], "decode", "prefill")]
    assert len(rounds) >= 2
    assert all(answers == expected for answers in rounds), [a for r in rounds for a in r if a not in expected][:3]
    for name, value in failures.items():
        assert metric(router.url, name) == value, name
    # each switched worker served its new role
    served = rooms_since(router, between)
    assert any(r["workers"]["decode"]["id"] == ids[x1.url] for r in served if r["events"][0]["t"] < after)
    for i in range(3):  # round robin over the three prefills
        assert ask(router.base_url, messages(f"after the switch {i}", []), stream=False, max_tokens=3)
    finals = rooms_since(router, after)
    assert {ids[x1.url], ids[x2.url]} <= {r["workers"]["prefill"]["id"] for r in finals}
    assert [httpx.get(f"{s.url}/server_info", timeout=10).json()["role"] for s in (x1, x2)] == ["prefill", "prefill"]
    refused = admin(router, "POST", "/ratio", json={"prefill": 0, "decode": 4})
    assert (refused.status_code, refused.json()["error"]["code"]) == (400, "invalid_split")
    back = admin(router, "POST", "/ratio", json={"prefill": 2, "decode": 2})
    assert back.status_code == 200 and [s["to"] for s in back.json()["switched"]] == ["decode"]


# --- timelines ---------------------------------------------------------------------------------
def test_a_room_timeline_has_every_stage_in_order(router):
    started = time.time()
    ask(router.base_url, messages("timeline", [data_url(png(48, 48, 5))]), stream=True, max_tokens=6)
    (record,) = rooms_since(router, started)
    view = admin(router, "GET", f"/rooms/{record['room']}").json()
    assert view["outcome"] == "success" and set(view["stages"]) == {"prefill", "decode"}
    events = {stage: [e["event"] for e in info["events"]] for stage, info in view["stages"].items()}
    # the prefill's forward pass starts when its own half arrives: it may end before or after pairing
    assert events["prefill"] in (["queued", "paired", "prefilled", "kv_written", "ready_sent"],
                                 ["queued", "prefilled", "paired", "kv_written", "ready_sent"])
    assert events["decode"] == ["queued", "blocks_reserved", "kv_requested", "kv_ready", "first_token", "finished"]
    at = {(e["stage"], e["event"]): e for e in view["timeline"]}
    times = [e["t"] for e in view["timeline"]]
    assert times == sorted(times) and view["timeline"][0]["event"] == "received"
    assert view["timeline"][-1] == {"stage": "router", "event": "done", "t": times[-1]}
    for stage, names in events.items():  # each stage's own events are in order, within the router's dispatch..done
        stage_times = [at[(stage, name)]["t"] for name in names]
        assert stage_times == sorted(stage_times)
        assert at[("router", "dispatched")]["t"] <= stage_times[0] and stage_times[-1] <= at[("router", "done")]["t"]
    assert at[("prefill", "ready_sent")]["t"] <= at[("decode", "kv_ready")]["t"]
    assert at[("prefill", "kv_written")]["bytes"] > 0 and at[("prefill", "kv_written")]["seconds"] > 0
    assert at[("decode", "finished")]["completion_tokens"] == 6
    assert admin(router, "GET", "/rooms/12345").status_code == 404


# --- ratio -------------------------------------------------------------------------------------
async def phase(router, bodies: list[dict]) -> dict:
    """Run ``bodies`` 4 at a time; the ratio report over exactly that stretch."""
    admin(router, "GET", "/ratio")  # a fresh sample marks the start
    await asyncio.sleep(0.1)  # the window below starts after it, so the previous phase's last interval is out
    started = time.monotonic()
    async with httpx.AsyncClient(timeout=120) as client:
        for i in range(0, len(bodies), 4):
            answers = await asyncio.gather(*(client.post(f"{router.url}/v1/chat/completions", json=b)
                                             for b in bodies[i:i + 4]))
            assert [a.status_code for a in answers] == [200] * len(answers)
    report = admin(router, "GET", f"/ratio?window_s={time.monotonic() - started + 0.05:.3f}")
    assert report.status_code == 200, report.text
    return report.json()


async def test_the_ratio_recommendation_moves_the_right_way(router):
    images = [data_url(png(96, 96, 40 + k)) for k in range(3)]
    encode_heavy = [{"messages": messages(f"look {i}", images), "max_tokens": 2, "temperature": 0} for i in range(12)]
    decode_heavy = [text_body(i, 48) for i in range(12)]
    a = await phase(router, encode_heavy)
    b = await phase(router, decode_heavy)
    assert a["demand"]["images_per_s"] > 0 and b["demand"]["images_per_s"] == 0
    assert a["demand"]["prefill_tokens_per_s"] > a["demand"]["decode_tokens_per_s"]
    assert b["demand"]["decode_tokens_per_s"] > b["demand"]["prefill_tokens_per_s"] > 0
    for report in (a, b):
        assert report["current"] == {"prefill": 2, "decode": 2}
        for role in ("prefill", "decode"):
            assert report["roles"][role]["capacity_per_busy_s"] > 0 and 0 < report["roles"][role]["utilization"] < 1
    share = (lambda r: r["roles"]["prefill"]["demand_per_s"] / r["roles"]["prefill"]["capacity_per_busy_s"] /
             (r["roles"]["decode"]["demand_per_s"] / r["roles"]["decode"]["capacity_per_busy_s"]))
    assert share(a) > share(b)
    assert a["recommended"]["prefill"] > b["recommended"]["prefill"], (a["recommended"], b["recommended"])
    assert a["apply"] == a["recommended"] and b["apply"] == b["recommended"]


# --- CLI ---------------------------------------------------------------------------------------
def stage_admin(router, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cli", "admin", *args, "--router", router.url], cwd=REPO,
                          capture_output=True, text=True, timeout=60, env={"EPD_ADMIN_TOKEN": TOKEN, "PATH": ""})


def test_the_admin_cli(router, prefill):
    result = stage_admin(router, "workers")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["ID", "ROLE", "URL", "HEALTH", "CIRCUIT", "OUT", "QUEUE", "KV", "GROUP", "DRAINING",
                                "SWITCHABLE"]
    assert lines[1].split()[:5] == ["w1", "prefill", prefill.url, "ok", "closed"]
    started = time.time()
    ask(router.base_url, messages("cli", []), stream=False, max_tokens=3)
    (record,) = rooms_since(router, started)
    room = stage_admin(router, "room", str(record["room"]))
    assert room.returncode == 0, room.stderr
    assert room.stdout.splitlines()[0].startswith(f"room {record['room']}: success, ")
    assert any(line.split()[1:3] == ["prefill", "kv_written"] for line in room.stdout.splitlines()[2:])
    ratio = stage_admin(router, "ratio", "--json")
    assert ratio.returncode == 0 and '"recommended"' in ratio.stdout
    missing = stage_admin(router, "drain", "w99")
    assert (missing.returncode, missing.stderr.strip()) == (
        1, "stage admin: HTTP 404: no worker 'w99'; GET /admin/workers lists them")
    wait_metric(router.url, "epd_router_in_flight_requests", 0.0)


# --- a stage that answers JSON that is not an object -----------------------------------------------
async def serve_stub(routes: dict[str, object]) -> tuple[web.AppRunner, str]:
    """A server on 127.0.0.1 answering 200 with each route's JSON (a route absent: 404). It stands for a
    stage that answers malformed JSON, which no real stage does."""
    def answering(answer: object) -> Callable[[web.Request], Awaitable[web.Response]]:
        async def handler(request: web.Request) -> web.Response:
            return web.json_response(answer)

        return handler

    app = web.Application()
    for path, answer in routes.items():
        app.router.add_route("*", path, answering(answer))
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"


@pytest.mark.parametrize("info", [["a", "list"], "a string"])
async def test_an_add_whose_server_info_is_not_an_object_is_refused_naming_it(router, decode, info):
    models = httpx.get(f"{decode.url}/v1/models", timeout=10).json()
    runner, url = await serve_stub({"/health": {"status": "ok"}, "/v1/models": models, "/server_info": info})
    try:
        async with httpx.AsyncClient(headers=AUTH, timeout=60) as client:
            before = (await client.get(f"{router.url}/admin/workers")).json()["workers"]
            response = await client.post(f"{router.url}/admin/workers", json={"url": url, "role": "decode"})
            assert response.status_code == 409, response.text
            assert response.json()["error"] == {
                "message": f"GET {url}/server_info did not answer a JSON object", "type": "invalid_request_error",
                "param": None, "code": "worker_misfit"}
            assert [w["id"] for w in (await client.get(f"{router.url}/admin/workers")).json()["workers"]] == [
                w["id"] for w in before]
    finally:
        await runner.cleanup()


async def test_a_decode_whose_dial_answer_is_not_an_object_is_added_but_never_paired(router, decode):
    """The decode's ``POST /admin/allowed_bootstrap`` answers 200 with a JSON array (it used to crash the
    add with a 500): every pair with it is refused, naming it, and it can be removed."""
    info = httpx.get(f"{decode.url}/server_info", timeout=10).json()
    models = httpx.get(f"{decode.url}/v1/models", timeout=10).json()
    runner, url = await serve_stub({"/health": {"status": "ok"}, "/v1/models": models, "/server_info": info,
                                    "/admin/allowed_bootstrap": ["not", "an", "object"]})
    try:
        async with httpx.AsyncClient(headers=AUTH, timeout=60) as client:
            listing = (await client.get(f"{router.url}/admin/workers")).json()["workers"]
            prefills = [w["id"] for w in listing if w["role"] == "prefill"]
            response = await client.post(f"{router.url}/admin/workers", json={"url": url, "role": "decode"})
            assert response.status_code == 200, response.text
            added = response.json()["worker"]["id"]
            why = f"decode {added} ({url}) answered HTTP 200 with a JSON array, not an object"
            assert response.json()["dial"] == {f"{p} -> {added}": f"refused, never paired: {why}" for p in prefills}
            pairs = (await client.get(f"{router.url}/admin/pairing")).json()["pairs"]
            assert {(pair["prefill"], pair["allowed"]) for pair in pairs if pair["decode"] == added} == {
                (p, False) for p in prefills}
            for i in range(4):  # never picked: every request is served by the real workers
                assert (await asyncio.to_thread(ask, router.base_url, messages(f"stub {i}", []), stream=False,
                                                max_tokens=2))[1]["completion_tokens"] == 2
            response = await client.delete(f"{router.url}/admin/workers/{added}")
            assert response.status_code == 200, response.text
            assert [w["id"] for w in (await client.get(f"{router.url}/admin/workers")).json()["workers"]] == [
                w["id"] for w in listing]
    finally:
        await runner.cleanup()
