"""schemathesis against each role's own ``/openapi.json``, on real servers (tiny model, loopback):
colocated, prefill, decode, encoder (on a real Redis) and a router in front of the colocated server.

Every answer must be documented (status, media type, headers, body schema), invalid bodies must be
refused, and no 5xx may come back except those the role documents for a request whose other half
never comes: a prefill waits ``--pair-timeout-s`` for the decode's KV request (504), a decode's KV
request reaches a prefill that never gets the HTTP half (502 or 504). Afterwards each server is
healthy, with nothing running or queued and every KV block free. The router's admin routes that
change something are fuzzed without its token (each a documented 401: with it, random bodies would
add workers that dial anywhere); its admin GETs with it.

Each operation gets ``FUZZ_EXAMPLES`` valid cases and, where it has a body, as many invalid ones,
seeded (``derandomize``). The test drives ``operation.as_strategy()`` with hypothesis itself:
schemathesis's loader for a schema served by a fixture (``schemathesis.pytest.from_fixture``) fails
on pytest 9 (``Node._nodeid`` is gone), and with it its coverage phase, so the schema's boundary
values are sent explicitly (``BOUNDARY_BODIES``).
"""

from __future__ import annotations

import random
import re
import time
from collections import Counter

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis import checks as schemathesis_checks
from schemathesis.specs.openapi import checks as openapi_checks

from contract.errors import Code
from stages.api.schema_types import MAX_HOST_CHARS
from stages.api.schemas import ChatCompletionRequest
from process.ports import free_port
from tests.support.redis_fixtures import redis_server  # noqa: F401

pytestmark = pytest.mark.timeout(240)
FUZZ_EXAMPLES = 30
ROOMS = random.Random(0)  # distinct rooms for the bodies that come without one
MODEL = "tiny-vl"
SERVE = ["--kv-cache-mib", "16", "--max-model-len", "256", "--served-model-name", MODEL]
PD = ["--transfer", "mooncake", "--pair-timeout-s", "1"]
ADMIN_TOKEN = "fuzz-admin-token-0123456789"
ROUTER_PATIENCE = ["--health-timeout-s", "10"]  # a loaded machine's slow /health is not a dead stage (no 503)
CHECKS = [openapi_checks.status_code_conformance, openapi_checks.content_type_conformance,
          openapi_checks.response_headers_conformance, openapi_checks.response_schema_conformance,
          openapi_checks.negative_data_rejection]
# what a body valid by the schema may still be refused for, as no schema can say it (code, param pattern):
# its prompt (the tools' definitions included) over the context, a named tool_choice not among its tools,
# a tool call's arguments that are no JSON text, a token id outside the model's vocabulary, an image that
# is not one (a URL string that is no data: URL of an image, a host not allowed, ...), more image parts
# over all its messages than the stages take; and an image part of the kind the stages' mode does not
# take (image_ref but with an embedding cache: one schema documents every role); the same for videos,
# and video settings (mm_processor_kwargs) past the server's bounds
BEYOND_SCHEMA = [(Code.CONTEXT_LENGTH_EXCEEDED, ".*"), ("image_ref_not_supported", ".*"),
                 ("image_url_not_supported", ".*"), ("video_ref_not_supported", ".*"),
                 ("video_url_not_supported", ".*"),
                 (Code.INVALID_VALUE, r"tool_choice|messages\[\d+\]\.tool_calls|prompt(\[\d+\])*|logit_bias|"
                                      r"mm_processor_kwargs(\..*)?"),
                 *((code, ".*") for code in (Code.INVALID_IMAGE_URL, Code.INVALID_BASE64, Code.INVALID_IMAGE,
                                             Code.IMAGE_HOST_NOT_ALLOWED, Code.IMAGE_FETCH_FAILED,
                                             Code.REMOTE_IMAGE_URL, Code.IMAGE_TOO_LARGE, Code.TOO_MANY_IMAGES,
                                             Code.INVALID_VIDEO_URL, Code.INVALID_VIDEO, Code.VIDEO_TOO_LARGE,
                                             Code.TOO_MANY_VIDEOS, Code.VIDEO_NOT_SUPPORTED))]


def positive_data_acceptance(ctx, response, case):
    """schemathesis's check, but for a 400 that names what no schema can say (``BEYOND_SCHEMA``)."""
    error = response.json().get("error", {}) if response.status_code == 400 else {}
    code, param = error.get("code"), error.get("param") or ""
    if any(code == known and re.fullmatch(pattern, param) for known, pattern in BEYOND_SCHEMA):
        return None
    return openapi_checks.positive_data_acceptance(ctx, response, case)


schemathesis_checks.load_all_checks()
# --checks all for the router: its document promises no more than it keeps
ALL_CHECKS = [positive_data_acceptance if check is openapi_checks.positive_data_acceptance else check
              for check in schemathesis_checks.CHECKS.get_all()]
# for the stages, positive_data_acceptance is left out on purpose: a body valid by the schema is still refused with a
# documented 400 when its prompt plus max_tokens outruns the context, or an image part has no data: URL.
FUZZ = settings(max_examples=FUZZ_EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def model(tiny_model):
    return str(tiny_model("qwen2_vl"))


@pytest.fixture(scope="module")
def colocated(start_server, model):
    return start_server("colocated", "--model", model, *SERVE)


@pytest.fixture(scope="module")
def bootstrap_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def prefill(start_server, model, bootstrap_port):
    return start_server("prefill", "--model", model, *SERVE, *PD, "--bootstrap-port", str(bootstrap_port))


@pytest.fixture(scope="module")
def decode(start_server, model, prefill):
    return start_server("decode", "--model", model, *SERVE, *PD, "--accept-timeout-s", "1")


@pytest.fixture(scope="module")
def router(start_server, colocated):
    return start_server("router", "--colocated", colocated.url, "--admin-token", ADMIN_TOKEN, *ROUTER_PATIENCE)


@pytest.fixture(scope="module")
def encoder(start_server, model, redis_server):  # noqa: F811
    return start_server("encoder", "--model", model, "--redis-url", redis_server.url)


def call_and_check(case, server, allowed_5xx: frozenset[int], headers: dict | None = None, checks: list = CHECKS):
    response = case.call(base_url=server.url, timeout=30, headers=headers)
    assert response.status_code < 500 or response.status_code in allowed_5xx, (
        f"{case.operation.label}: {response.status_code} {response.text[:500]}")
    case.validate_response(response, checks=checks, headers=headers)
    return response


def completed(case, mode: GenerationMode, bootstrap_port: int | None = None) -> None:
    """Make a valid body likelier to get through: the served model's id where it names a model (any
    other is a documented 404), and for prefill and decode a room on the test's own prefill (so a
    decode dials nothing else) with the room fields the schema leaves optional but these roles need.
    A value the fuzzer made invalid on purpose (wrong type, too long, out of range) stays."""
    body = case.body
    if not isinstance(body, dict):
        return
    positive = mode is GenerationMode.POSITIVE
    if positive and isinstance(body.get("model"), str):
        body["model"] = MODEL
    if bootstrap_port is None:
        return
    host, port = body.get("bootstrap_host"), body.get("bootstrap_port")
    if isinstance(host, str) and len(host) <= MAX_HOST_CHARS or host is None and positive:
        body["bootstrap_host"] = "127.0.0.1"
    if type(port) is int and 1 <= port <= 65535 or port is None and positive:
        body["bootstrap_port"] = bootstrap_port
    if body.get("bootstrap_room") is None and positive:
        body["bootstrap_room"] = ROOMS.getrandbits(63)


SETTLED_GAUGES = ("epd_running_requests ", "epd_kv_blocks_used ", "epd_queue_depth ", "epd_encoder_queue_depth ",
                  "epd_router_in_flight_requests ")


def assert_settled(server, within_s: float = 15.0) -> None:
    """Healthy, and (once abandoned rooms expire) nothing running or queued and no KV block held."""
    deadline = time.monotonic() + within_s
    while True:
        health = httpx.get(f"{server.url}/health", timeout=10)
        text = httpx.get(f"{server.url}/metrics", timeout=10).text
        gauges = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
                  if line.startswith(SETTLED_GAUGES)}
        if health.status_code == 200 and gauges and not any(gauges.values()):
            break
        assert time.monotonic() < deadline, f"{health.status_code} {health.text} {gauges}"
        time.sleep(0.2)
    assert health.json()["status"] == "ok"


def operations(server) -> list:
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    return [result.ok() for result in schema.get_all_operations()]


def fuzz(server, allowed_5xx: frozenset[int] = frozenset(), bootstrap_port: int | None = None,
         admin_token: str | None = None, checks: list = CHECKS) -> dict[str, Counter]:
    """Every operation of ``server``'s document, valid cases and (where there is an input to break)
    invalid ones; with ``admin_token``, the router's admin GETs carry it (they change nothing).
    Returns the statuses seen per operation and mode."""
    seen: dict[str, Counter] = {}
    for operation in operations(server):
        reads = admin_token and operation.method.upper() == "GET" and operation.path.startswith("/admin/")
        headers = {"Authorization": f"Bearer {admin_token}"} if reads else None
        modes = [GenerationMode.POSITIVE] + ([GenerationMode.NEGATIVE] if operation.body else [])
        for mode in modes:
            statuses = seen.setdefault(f"{operation.label} {mode.value}", Counter())

            @FUZZ
            @given(case=operation.as_strategy(generation_mode=mode))
            def run(case) -> None:
                completed(case, mode, bootstrap_port)
                statuses[call_and_check(case, server, allowed_5xx, headers, checks).status_code] += 1

            run()
    return seen


def test_colocated_answers_as_documented(colocated):
    seen = fuzz(colocated)
    assert seen["POST /v1/chat/completions positive"][200] > 0, seen  # the fuzzer got through, not just 400s
    assert seen["POST /v1/completions positive"][200] > 0, seen


def test_prefill_answers_as_documented(prefill, bootstrap_port):
    seen = fuzz(prefill, frozenset({504}), bootstrap_port)
    assert seen["POST /v1/chat/completions positive"][504] > 0, seen  # valid rooms waited for their decode


def test_decode_answers_as_documented(decode, bootstrap_port):
    seen = fuzz(decode, frozenset({502, 504}), bootstrap_port)
    chat = seen["POST /v1/chat/completions positive"]
    assert chat[502] + chat[504] > 0, seen  # valid rooms reached the prefill, which never got their other half


def test_router_answers_as_documented(router):
    seen = fuzz(router, admin_token=ADMIN_TOKEN, checks=ALL_CHECKS)
    assert seen["POST /v1/chat/completions positive"][200] > 0, seen  # through to the stage and back
    assert seen["POST /v1/completions positive"][200] > 0, seen
    assert set(seen["GET /admin/workers positive"]) == {200}, seen  # the token reads
    assert seen["GET /admin/rooms/{room} positive"][404] > 0, seen  # no such room
    removals = seen["DELETE /admin/workers/{id} positive"]  # no token, no entry (404: an id that is no path)
    assert removals[401] > 0 and set(removals) <= {401, 404}, seen
    superscript = httpx.get(f"{router.url}/admin/rooms/%C2%B2", timeout=10,  # "²" is a digit, not a room number
                            headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    assert superscript.status_code == 404, superscript.text  # was a 500 (int("²")), found by the fuzzer


def test_encoder_answers_as_documented(encoder):
    seen = fuzz(encoder)
    assert seen["POST /v1/encode positive"][200] > 0, seen  # e.g. no images: nothing to encode
    assert seen["POST /v1/abort positive"][200] > 0, seen


def test_a_405_names_the_allowed_methods_on_every_role(colocated, prefill, decode, encoder, router):
    for server in (colocated, prefill, decode, encoder, router):
        for method, path, allowed in (("GET", "/v1/chat/completions", "POST"), ("POST", "/health", "GET"),
                                      ("PUT", "/metrics", "GET")):
            if server is encoder and path == "/v1/chat/completions":
                path, allowed = "/v1/encode", "POST"
            response = httpx.request(method, f"{server.url}{path}", timeout=10)
            assert response.status_code == 405, (server.url, method, path)
            assert allowed in response.headers["allow"].replace(" ", "").split(","), (server.url, path)
            assert response.json()["error"]["code"] == "method_not_allowed"


HI = [{"role": "user", "content": "hi"}]
BOUNDARY_BODIES = {  # valid by the schema, each at an edge of it; max_tokens small to keep it quick
    "denormal temperature": {"temperature": 5e-324}, "hottest": {"temperature": 2},
    "denormal top_p": {"top_p": 1e-320, "temperature": 1}, "top_k past 64 bits": {"top_k": 2**70},
    "top_k -1": {"top_k": -1}, "lowest seed": {"seed": -(2**63)}, "highest seed": {"seed": 2**63 - 1},
    "longest stops": {"stop": ["\u00e9" * 256, "x" * 256, "stop", "\n"]},
    "most parts": {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * 64}]},
    "highest room": {"bootstrap_room": 2**63 - 1, "bootstrap_host": "x" * 255, "bootstrap_port": 65535},
    "integral floats": {"max_tokens": 4.0, "seed": 7.0, "n": 1.0},
    "usage stream": {"stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True},
    "denormal repetition_penalty": {"repetition_penalty": 5e-324, "logit_bias": {"0": 100, "1": -100}},
    "most choices and logprobs": {"n": 8, "logprobs": True, "top_logprobs": 20, "presence_penalty": -2,
                                  "frequency_penalty": 2},
}


def chat_case(server, body: dict):
    operation = next(op for op in operations(server) if op.label == "POST /v1/chat/completions")
    return operation.Case(body=body, media_type="application/json")


@pytest.mark.parametrize("name", list(BOUNDARY_BODIES))
def test_boundary_values_on_a_real_engine(colocated, name):
    body = {"messages": HI, "max_tokens": 4, **BOUNDARY_BODIES[name]}
    assert call_and_check(chat_case(colocated, body), colocated, frozenset()).status_code == 200


def test_as_many_messages_as_allowed_reach_the_context_check(colocated):
    response = call_and_check(chat_case(colocated, {"messages": HI * 2048}), colocated, frozenset())
    assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"


def test_every_server_is_settled_after_the_fuzzing(colocated, prefill, decode, encoder, router):
    for server in (colocated, prefill, decode, encoder, router):
        assert_settled(server)


def test_the_documents_describe_each_role(colocated, prefill, decode):
    """The chat body is the request model itself; every role has /server_info."""
    request_schema = ChatCompletionRequest.model_json_schema(ref_template="#/components/schemas/{model}")
    del request_schema["$defs"]  # each is a component of its own
    documents = {name: httpx.get(f"{s.url}/openapi.json", timeout=10).json()
                 for name, s in (("colocated", colocated), ("prefill", prefill), ("decode", decode))}
    for name, document in documents.items():
        chat = document["paths"]["/v1/chat/completions"]["post"]
        assert chat["requestBody"]["content"]["application/json"]["schema"] == {
            "$ref": "#/components/schemas/ChatCompletionRequest"}, name
        assert document["components"]["schemas"]["ChatCompletionRequest"] == request_schema, name
        assert set(chat["responses"]) == {"200", "400", "403", "404", "409", "413", "499", "500", "502", "503",
                                          "504"}, name
        assert "Retry-After" in chat["responses"]["503"]["headers"]
        assert list(document["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]
        assert not any(path.startswith("/debug") for path in document["paths"]), name
    assert all("/server_info" in documents[role]["paths"] for role in ("colocated", "prefill", "decode"))


def test_the_encoder_and_router_documents(encoder, router, colocated):
    """The encoder's bodies are its request models; the router's chat body is the stage's; both serve
    /metrics as text and document /server_info."""
    from stages.encoder.routes import AbortRequest, EncodeRequest

    encoder_doc = httpx.get(f"{encoder.url}/openapi.json", timeout=10).json()
    for path, model in (("/v1/encode", EncodeRequest), ("/v1/abort", AbortRequest)):
        body = encoder_doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{model.__name__}"}, path
        expected = model.model_json_schema(ref_template="#/components/schemas/{model}")
        expected.pop("$defs", None)
        assert encoder_doc["components"]["schemas"][model.__name__] == expected, path
    router_doc = httpx.get(f"{router.url}/openapi.json", timeout=10).json()
    stage_doc = httpx.get(f"{colocated.url}/openapi.json", timeout=10).json()
    assert router_doc["paths"]["/v1/chat/completions"]["post"]["requestBody"] == \
        stage_doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]
    for document in (encoder_doc, router_doc):
        assert list(document["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]
        assert "/server_info" in document["paths"]


def test_a_pd_router_documents_its_stages_chat_schema(start_server, prefill, decode):
    """In pd mode too: a valid OpenAPI document whose chat body is the stages', and /server_info's
    workers per role and the stages' limits."""
    router = start_server("router", "--prefill", prefill.url, "--decode", decode.url, *ROUTER_PATIENCE)
    schemathesis.openapi.from_url(f"{router.url}/openapi.json").validate()
    chat = httpx.get(f"{router.url}/openapi.json", timeout=10).json()["paths"]["/v1/chat/completions"]["post"]
    stage_chat = httpx.get(f"{decode.url}/openapi.json", timeout=10).json()["paths"]["/v1/chat/completions"]["post"]
    assert chat["requestBody"] == stage_chat["requestBody"]
    info = httpx.get(f"{router.url}/server_info", timeout=10).json()
    assert (info["role"], info["mode"], info["chat_schema_from"]) == ("router", "pd", prefill.url)
    assert info["workers"] == {role: {"total": 1, "known": 1, "healthy": 1} for role in ("prefill", "decode")}
    stage = httpx.get(f"{prefill.url}/server_info", timeout=10).json()["limits"]
    assert info["stage_limits"] == {"max_body_bytes": 64 << 20, "max_images_per_request": 8,
                                    "max_videos_per_request": 2, "max_model_len": stage["max_model_len"], "chars_per_token": stage["chars_per_token"]}
    assert stage["max_model_len"] > 0 and stage["chars_per_token"] > 0
