"""The tests every transfer's 2E2P2D rig runs (``test_parity_mooncake.py``, ``test_parity_nixl.py``
import them; the module's ``TRANSFER`` picks the backend). Each stage on its own host, the client
on its own: greedy parity with ``generate()`` through the router for 0, 1 and 3 images, stream and
not; every (P, D) pair serves; no wildcard listener beyond Mooncake's documented two; a poser outside
``--allowed-bootstrap`` gets 403 and is never dialed; the Redis password shows nowhere; the admin
API from the client host without the token is 401. KV blocks are back to zero after every test.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import httpx
import pytest
import redis

from tests.multihost.rig import BOOTSTRAP_PORT, HOSTS, REDIS_PORT
from tests.multihost.stack import ADMIN_TOKEN, CASES, MOONCAKE_PORTS, STEPS, Reference, Stack, ask, case_images, \
    pair_of, start_stack
from tests.support.router_helpers import data_url, messages

pytestmark = pytest.mark.timeout(240)
SALT = {"mooncake": 1, "nixl": 2}  # images new to each rig's Redis, whatever ran before


@pytest.fixture(scope="module")
def stack(request, make_rig) -> Iterator[Stack]:
    transfer = request.module.TRANSFER
    yield start_stack(make_rig(4), transfer)


@pytest.fixture(scope="module")
def reference() -> Reference:
    return Reference()


@pytest.fixture(autouse=True)
def blocks_back_to_zero(stack: Stack) -> Iterator[None]:
    yield
    deadline = time.monotonic() + 10
    while any(used := stack.blocks_used()):
        assert time.monotonic() < deadline, f"KV blocks still in use on (p1, p2, d1, d2): {used}"
        time.sleep(0.1)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_router_answer_equals_generate(stack, reference, case, stream):
    text = CASES[case][0]
    images = case_images(case, 10 * SALT[stack.transfer] + stream)
    answer, usage = stack.rig.client(ask, stack.router.base_url, text, images, stream)
    expected, prompt_tokens, completion_tokens = reference.expected(text, images)
    assert answer == expected
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (prompt_tokens, completion_tokens)


def test_every_prefill_decode_pair_serves(stack, reference):
    """Round robin on both pools pairs p1 with d1 and p2 with d2; pairing by group with crossed
    links (each stage's group is its host) makes the other two pairs. The router's room record names
    the pair, and each of the two stages reports the room at its own /rooms/{room}."""
    text = "hello, who are you?"
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": STEPS, "temperature": 0}
    expected = reference.expected(text, [])[0]
    seen = [pair_of(stack, body) for _ in range(2)]
    crossed = {"by": "group", "links": {"p1": ["d2"], "p2": ["d1"]}}
    assert stack.admin("PUT", "/admin/pairing", json=crossed).status_code == 200
    try:
        seen += [pair_of(stack, body) for _ in range(2)]
    finally:
        assert stack.admin("PUT", "/admin/pairing", json={"by": "any"}).status_code == 200
    assert {pair for pair, _ in seen} == {("p1", "d1"), ("p2", "d2"), ("p1", "d2"), ("p2", "d1")}, seen
    assert [content for _, content in seen] == [expected] * 4


def test_no_wildcard_listener_on_any_host(stack):
    """Every listener in every host's namespace is on that host's own address; the one exception is
    Mooncake's (tests/stages/test_listeners.py): on a prefill or decode host over Mooncake, exactly its two
    wildcard ports (0.0.0.0 and ::) in its RPC port range."""
    stack.rig.client(ask, stack.router.base_url, "hi", case_images("one_image", 90 + SALT[stack.transfer]), False)
    for host in HOSTS:
        found = stack.rig.listeners(host)
        own = {stack.rig.addr(host, 4), stack.rig.addr(host, 6)}
        wildcards = sorted((a, p) for a, p in found if a in ("0.0.0.0", "::"))
        if stack.transfer == "mooncake" and host[0] in "pd":
            assert sorted(a for a, _ in wildcards) == ["0.0.0.0", "::"], (host, found)
            assert all(MOONCAKE_PORTS[0] <= p <= MOONCAKE_PORTS[1] for _, p in wildcards), (host, found)
        else:
            assert wildcards == [], (host, found)
        assert {a for a, _ in found} - own - {"0.0.0.0", "::"} == set(), (host, found)


def _listen(address: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET)
    sock.bind((address, port))
    sock.listen(8)
    sock.setblocking(False)
    return sock


def _accepted(sock: socket.socket) -> bool:
    try:
        sock.accept()[0].close()
        return True
    except BlockingIOError:
        return False


def test_a_poser_outside_allowed_bootstrap_is_403_and_never_dialed(stack):
    """The client host listens on the bootstrap port and names itself as the prefill: each decode
    answers 403 naming --allowed-bootstrap, opens no link to it, and nothing connects to it."""
    rig = stack.rig
    poser = rig.addr("client")
    listener = rig.client(_listen, poser, BOOTSTRAP_PORT)
    try:
        for i, decode in enumerate(stack.decodes):
            body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0,
                    "bootstrap_host": poser, "bootstrap_port": BOOTSTRAP_PORT, "bootstrap_room": 4242 + i}
            response = rig.client(httpx.post, f"{decode.url}/v1/chat/completions", json=body, timeout=10)
            assert response.status_code == 403, response.text
            error = response.json()["error"]
            assert (error["code"], error["param"]) == ("bootstrap_not_allowed", "bootstrap_host")
            assert f"{rig.hostport('client', BOOTSTRAP_PORT)} is not allowed by --allowed-bootstrap" in error["message"]
            links = stack.get(f"{decode.url}/server_info").json()["peer_links"]["open"]
            assert not any(poser in link for link in links), links
        assert not _accepted(listener)
    finally:
        listener.close()


def test_the_redis_password_shows_in_no_log_metric_info_or_error_body(stack):
    """Redis asks for the password (a client without it is refused), every role used it (an image
    was encoded, cached and read), and it is in no log line, /metrics, /server_info or error body."""
    rig = stack.rig
    with pytest.raises(redis.AuthenticationError):
        rig.client(lambda: redis.Redis.from_url(f"redis://{rig.hostport('redis', REDIS_PORT)}/0", socket_timeout=2).ping())
    rig.client(ask, stack.router.base_url, "what is it", case_images("one_image", 80 + SALT[stack.transfer]), True)
    bodies = []
    for server in (*stack.stages, stack.router):
        for path in ("/metrics", "/server_info", "/health", "/v1/models"):
            bodies.append(stack.get(f"{server.url}{path}").text)
    errors = [rig.client(httpx.post, f"{stack.router.url}/v1/chat/completions", content=b"{", timeout=10),
              rig.client(httpx.post, f"{stack.router.url}/v1/chat/completions", timeout=10,
                         json={"messages": [{"role": "user", "content": [
                             {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}),
              stack.admin("GET", "/admin/workers", token=None), stack.get(f"{stack.router.url}/nowhere")]
    assert all(r.status_code >= 400 for r in errors), [r.status_code for r in errors]
    rig.block("redis", REDIS_PORT, "reject")  # the error that names Redis is where its URL would leak
    try:
        outage = rig.client(httpx.post, f"{stack.router.url}/v1/chat/completions", timeout=30, json={
            "messages": messages("what is it", [data_url(b) for b in case_images("one_image", 70 + SALT[stack.transfer])]),
            "max_tokens": 2})
    finally:
        rig.unblock("redis", REDIS_PORT)
    assert outage.status_code == 503 and "redis" in outage.text.lower(), outage.text
    errors.append(outage)
    bodies += [r.text for r in errors] + [stack.admin("GET", "/admin/workers").text]
    logs = [server.log() for server in rig.servers] + [(rig.logs / "redis.log").read_text(errors="replace")]
    password = rig.redis_password
    assert all(password not in body for body in bodies)
    assert [line for log in logs for line in log.splitlines() if password in line] == []
    assert stack.get(f"{stack.router.url}/server_info").status_code == 200


def test_the_admin_api_from_the_client_host_needs_the_token(stack):
    for token in (None, "wrong-token"):
        response = stack.admin("GET", "/admin/workers", token=token)
        assert response.status_code == 401, response.text
        assert response.json()["error"]["code"] == "unauthorized"
        assert response.headers["www-authenticate"] == "Bearer"
    assert stack.admin("GET", "/admin/workers", token=ADMIN_TOKEN).status_code == 200
