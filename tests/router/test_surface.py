"""The router as a server like the stages: its ``/openapi.json`` (valid OpenAPI, the chat body taken
from a stage's own document when the stage registers), its ``/server_info``, ``Allow`` on 405, and
the stages' own limits (learned from their ``/server_info``) enforced before any fan-out.

Real processes on loopback: a colocated stage, routers in front of it, and a counting proxy (a real
HTTP server in a thread) that shows which requests reached the stage. Pure pieces (the document's
coverage of the app's routes, the limit arithmetic) are tested in-process.
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
import schemathesis

from contract.bootstrap import BOOTSTRAP_FIELDS
from router.config import RouterConfig
from router.errors import RouterError
from router.plan.images import check_count
from router.plan.limits import StageLimits, prompt_chars, prompt_too_long, published, tightest
from router.openapi import chat_part, document
from tests.support.router_helpers import data_url, messages, png

pytestmark = pytest.mark.timeout(180)
TOKEN = "surface-test-token-0123456789"
STAGE_MAX_BODY = 1 << 20  # the stage's --max-body-mb 1; the router's own default is 64 MiB
CHAT = "/v1/chat/completions"
PATIENCE = ("--health-timeout-s", "10")  # a loaded machine's slow /health is not a dead stage


class CountingProxy:
    """A real HTTP server in front of a stage: forwards every request, counts chat POSTs, and with
    ``hide_openapi`` answers 404 for ``/openapi.json`` (a stage that gives no schema)."""

    def __init__(self, upstream: str, hide_openapi: bool = False) -> None:
        self.chats = 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def _forward(self) -> None:
                if hide_openapi and self.path == "/openapi.json":
                    self.send_error(404)
                    return
                if self.command == "POST" and self.path == CHAT:
                    outer.chats += 1
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                answer = httpx.request(self.command, upstream + self.path, content=body, timeout=60,
                                       headers={"Content-Type": self.headers.get("Content-Type", "application/json")})
                self.send_response(answer.status_code)
                self.send_header("Content-Type", answer.headers.get("content-type", "application/json"))
                self.send_header("Content-Length", str(len(answer.content)))
                self.end_headers()
                self.wfile.write(answer.content)

            do_GET = do_POST = _forward  # noqa: N815

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def colocated(start_server, tiny_model):
    return start_server("colocated", "--model", str(tiny_model("qwen2_vl")), "--kv-cache-mib", "16",
                        "--max-body-mb", "1")


@pytest.fixture(scope="module")
def proxy(colocated):
    proxy = CountingProxy(colocated.url)
    yield proxy
    proxy.close()


@pytest.fixture(scope="module")
def router(start_server, proxy):
    return start_server("router", "--colocated", proxy.url, "--admin-token", TOKEN, *PATIENCE)


def get(url: str) -> dict:
    response = httpx.get(url, timeout=10)
    assert response.status_code == 200, response.text
    return response.json()


# --- /openapi.json -----------------------------------------------------------------------------
def test_the_document_is_valid_openapi_with_the_stages_chat_schema(router, colocated):
    schemathesis.openapi.from_url(f"{router.url}/openapi.json").validate()  # the OpenAPI 3.1 meta-schema
    mine, stage = get(f"{router.url}/openapi.json"), get(f"{colocated.url}/openapi.json")
    chat, stage_chat = mine["paths"][CHAT]["post"], stage["paths"][CHAT]["post"]
    assert chat["requestBody"] == stage_chat["requestBody"]
    assert chat["responses"]["200"]["content"] == stage_chat["responses"]["200"]["content"]
    schemas = mine["components"]["schemas"]
    stage_request = stage["components"]["schemas"]["ChatCompletionRequest"]
    assert set(BOOTSTRAP_FIELDS) <= set(stage_request["properties"])  # the stage takes them; a client never sends them
    assert schemas["ChatCompletionRequest"] == {**stage_request, "properties": {
        name: value for name, value in stage_request["properties"].items() if name not in BOOTSTRAP_FIELDS}}
    assert set(chat["responses"]) == {"200", "400", "403", "404", "409", "413", "500", "502", "503", "504"}
    assert "Retry-After" in chat["responses"]["503"]["headers"]
    assert list(mine["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]
    for path, item in mine["paths"].items():
        for method, operation in item.items():
            for status, answer in operation["responses"].items():
                if int(status) >= 400:
                    assert answer["content"]["application/json"]["schema"] == {
                        "$ref": "#/components/schemas/ErrorBody"}, (method, path, status)
            if path.startswith("/admin/"):
                assert operation["security"] == [{"adminToken": []}], (method, path)
                assert {"401", "403"} <= set(operation["responses"]), (method, path)
    assert mine["components"]["securitySchemes"]["adminToken"] == {
        "type": "http", "scheme": "bearer", "description": "The router's --admin-token (or EPD_ADMIN_TOKEN)."}


@pytest.mark.unit
def test_every_route_of_the_app_is_documented():
    from router.app import create_routes
    from router.runtime import Router

    table = create_routes(Router(RouterConfig(colocated=("http://127.0.0.1:9",))))
    routes = {(method.lower(), path) for method, path in table.listing() if path != "/openapi.json"}
    documented = {(method, path) for path, item in document(None)["paths"].items() for method in item}
    assert routes == documented


def test_before_a_stage_gives_its_schema_the_chat_body_is_an_object_then_learned_on_admin_add(
        start_server, colocated):
    """A stage whose /openapi.json is missing gives no schema; the next one added gives it."""
    hidden = CountingProxy(colocated.url, hide_openapi=True)
    try:
        router = start_server("router", "--colocated", hidden.url, "--admin-token", TOKEN, *PATIENCE)
        chat = get(f"{router.url}/openapi.json")["paths"][CHAT]["post"]
        assert chat["requestBody"]["content"]["application/json"]["schema"] == {"type": "object"}
        assert get(f"{router.url}/server_info")["chat_schema_from"] is None
        added = httpx.post(f"{router.url}/admin/workers", json={"url": colocated.url, "role": "colocated"},
                           headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
        assert added.status_code == 200, added.text
        learned = get(f"{router.url}/openapi.json")["paths"][CHAT]["post"]["requestBody"]
        assert learned == get(f"{colocated.url}/openapi.json")["paths"][CHAT]["post"]["requestBody"]
        assert get(f"{router.url}/server_info")["chat_schema_from"] == colocated.url
    finally:
        hidden.close()


# --- /server_info ------------------------------------------------------------------------------
def test_server_info_says_what_the_router_is(router, proxy, colocated):
    info = get(f"{router.url}/server_info")
    stage = get(f"{colocated.url}/server_info")
    assert stage["limits"]["max_images_per_request"] == 8 and stage["limits"]["max_body_bytes"] == STAGE_MAX_BODY
    assert isinstance(info.pop("instance_id"), str)
    assert info == {
        "role": "router", "mode": "colocated", "version": "0.1.0",
        "workers": {"colocated": {"total": 1, "known": 1, "healthy": 1}},
        "models": [card["id"] for card in get(f"{colocated.url}/v1/models")["data"]], "in_flight": 0,
        "limits": {"max_body_bytes": STAGE_MAX_BODY, "max_images_per_request": 8, "max_in_flight": 1024,
                   "max_image_bytes": 20 << 20, "max_videos_per_request": 2, "max_video_bytes": 64 << 20},
        "stage_limits": {"max_body_bytes": STAGE_MAX_BODY, "max_images_per_request": 8,
                         "max_videos_per_request": stage["limits"]["max_videos_per_request"],
                         "max_model_len": stage["limits"]["max_model_len"],
                         "chars_per_token": stage["limits"]["chars_per_token"]},
        "chat_schema_from": proxy.url}


# --- 405 ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(("method", "path", "allow"), [
    ("GET", CHAT, {"POST"}), ("POST", "/health", {"GET", "HEAD"}), ("POST", "/server_info", {"GET", "HEAD"}),
    ("DELETE", "/admin/pairing", {"GET", "HEAD", "PUT"})])
def test_405_names_the_allowed_methods(router, method, path, allow):
    response = httpx.request(method, f"{router.url}{path}", timeout=10)
    assert response.status_code == 405
    assert set(response.headers["allow"].split(",")) == allow
    assert response.json() == {"error": {"message": "Method Not Allowed", "type": "invalid_request_error",
                                         "param": None, "code": "method_not_allowed"}}


# --- the stages' limits, before any fan-out -----------------------------------------------------
def test_nine_images_are_refused_by_the_router_before_any_stage_sees_them(router, proxy, colocated):
    urls = [data_url(png(16, 16, seed)) for seed in range(9)]
    direct = httpx.post(f"{colocated.url}{CHAT}", json={"messages": messages("hi", urls), "max_tokens": 1})
    assert direct.status_code == 400 and direct.json()["error"]["code"] == "too_many_images"
    before = proxy.chats
    refused = httpx.post(f"{router.url}{CHAT}", json={"messages": messages("hi", urls), "max_tokens": 1})
    assert refused.status_code == 400
    assert refused.json() == {"error": {
        "message": "The request has 9 images; the stages behind this router accept at most 8 per request "
                   "(their --max-images-per-request).",
        "type": "invalid_request_error", "param": "messages", "code": "too_many_images"}}
    assert proxy.chats == before  # no stage saw it
    eight = httpx.post(f"{router.url}{CHAT}", json={"messages": messages("hi", urls[:8]), "max_tokens": 1},
                       timeout=60)
    assert eight.status_code == 200, eight.text
    assert proxy.chats == before + 1


def test_a_body_over_the_stages_cap_is_refused_by_the_router(router, proxy):
    big = b'{"messages": [{"role": "user", "content": "hi"}], "pad": "' + b"x" * STAGE_MAX_BODY + b'"}'
    before = proxy.chats
    refused = httpx.post(f"{router.url}{CHAT}", content=big, timeout=30)
    assert refused.status_code == 413
    assert refused.json()["error"] == {
        "message": f"The request body is {len(big)} bytes; the stages behind this router accept at most "
                   f"{STAGE_MAX_BODY} bytes (their --max-body-mb).",
        "type": "invalid_request_error", "param": None, "code": "request_too_large"}
    assert proxy.chats == before


def test_a_text_that_cannot_fit_is_refused_by_the_router_as_the_stage_would(router, proxy, colocated):
    limits = get(f"{colocated.url}/server_info")["limits"]
    max_chars = (limits["max_model_len"] - 1) * limits["chars_per_token"]
    assert max_chars + 200 < STAGE_MAX_BODY  # the stage's own body cap is not what refuses it
    body = {"messages": [{"role": "system", "content": "  be brief  "},
                         {"role": "user", "content": "x" * (max_chars - 7) + "   "}], "max_tokens": 1}
    direct = httpx.post(f"{colocated.url}{CHAT}", json=body, timeout=30)
    assert direct.status_code == 400 and direct.json()["error"]["code"] == "context_length_exceeded", direct.text
    before = proxy.chats
    refused = httpx.post(f"{router.url}{CHAT}", json=body, timeout=30)
    stage_error = {field: direct.json()["error"][field] for field in ("message", "type", "param", "code")}
    assert (refused.status_code, refused.json()) == (400, {"error": stage_error})  # word for word the stage's
    assert proxy.chats == before  # no stage saw it
    body["messages"][1]["content"] = "x" * (max_chars - 8)  # fits by its characters: the stage decides
    assert httpx.post(f"{router.url}{CHAT}", json=body, timeout=60).json()["error"]["code"] == "context_length_exceeded"
    assert proxy.chats == before + 1


@pytest.mark.unit
def test_the_text_counted_is_what_every_template_writes():
    assert prompt_chars([{"role": "user", "content": "  ab c \n"}, {"role": "assistant", "content": "long" * 99},
                         {"role": "system", "content": [{"type": "text", "text": "xyz"}, {"type": "image_url"}]},
                         {"role": "user", "content": None}, "not a message"]) == 4 + 3
    assert prompt_chars("not a list") == prompt_chars(None) == 0
    assert prompt_chars([{"role": "user", "content": "a" + " " * 5000}]) == 0  # a whitespace tail: the stage counts
    limits = StageLimits(max_model_len=11, chars_per_token=2)  # at most 20 characters
    assert prompt_too_long({"messages": [{"role": "user", "content": "x" * 20}]}, limits) is None
    refusal = prompt_too_long({"messages": [{"role": "user", "content": "x" * 21}]}, limits)
    assert refusal is not None and (refusal.status, refusal.code, refusal.param) == (400, "context_length_exceeded",
                                                                                     "messages")
    assert "hold 21 characters of text, at least 11 tokens" in refusal.message
    assert prompt_too_long({"messages": [{"role": "user", "content": "x" * 99}]}, StageLimits(max_model_len=11)) is None


@pytest.mark.unit
def test_the_tightest_published_limit_counts():
    each = [published({"limits": {"max_images_per_request": 8, "max_body_bytes": 100}}),
            published({"limits": {"max_images_per_request": 4}}), published({}),
            published({"limits": {"max_images_per_request": True, "max_body_bytes": -1}})]
    assert each[2] == each[3] == {}
    assert tightest(each) == StageLimits(max_body_bytes=100, max_images_per_request=4)
    assert tightest([]) == StageLimits()


@pytest.mark.unit
@pytest.mark.parametrize(("count", "own", "stages", "refused_with"), [
    (8, 16, 8, None), (9, 16, 8, "the stages behind this router accept at most 8"),
    (17, 16, None, "this router accepts at most 16"), (17, 16, 32, "this router accepts at most 16"),
    (16, 16, 32, None)])
def test_the_image_count_is_refused_in_the_words_of_whose_limit_it_is(count, own, stages, refused_with):
    if refused_with is None:
        check_count(count, own, stages)
        return
    with pytest.raises(RouterError) as caught:
        check_count(count, own, stages)
    assert (caught.value.status, caught.value.code, caught.value.param) == (400, "too_many_images", "messages")
    assert refused_with in caught.value.message


@pytest.mark.unit
def test_chat_part_takes_the_schemas_it_refers_to_and_no_others():
    stage = {"paths": {CHAT: {"post": {
        "requestBody": {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/A"}}}},
        "responses": {"200": {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/C"}}}}}}}},
        "components": {"schemas": {"A": {"properties": {"b": {"items": {"$ref": "#/components/schemas/B"}}}},
                                   "B": {"type": "string"}, "C": {"type": "object"}, "Unused": {}}}}
    part = chat_part(stage)
    assert set(part["schemas"]) == {"A", "B", "C"}
    assert part["schemas"]["A"] == stage["components"]["schemas"]["A"]


def test_chat_part_leaves_out_the_fields_the_router_writes():
    """A client's body is the stage's less the bootstrap fields (the router adds them; it drops a client's)."""
    request = {"type": "object", "required": ["messages", "bootstrap_room"], "properties": {
        "messages": {"type": "array"}, **{name: {"type": "integer"} for name in BOOTSTRAP_FIELDS}}}
    body = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Req"}}}}
    answer = {"200": {"content": {"application/json": {"schema": {"type": "object"}}}}}
    stage = {"paths": {CHAT: {"post": {"requestBody": body, "responses": answer}},
                       "/v1/completions": {"post": {"requestBody": body, "responses": answer}}},
             "components": {"schemas": {"Req": request}}}
    part = chat_part(stage)
    assert part["schemas"]["Req"] == {"type": "object", "required": ["messages"],
                                      "properties": {"messages": {"type": "array"}}}
    assert set(stage["components"]["schemas"]["Req"]["properties"]) > set(BOOTSTRAP_FIELDS)  # the stage's is kept
    with pytest.raises(KeyError):
        chat_part({"paths": {}})
