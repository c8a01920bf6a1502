"""JSON nested deeper than 64 levels of arrays and objects is a 400 ``invalid_json`` on every stage,
wherever the nesting is (was: 500 RecursionError at ~1000 levels on colocated, prefill and decode).
Brackets inside strings are text; 64 levels are accepted. The rule itself: tests/contract/test_json_depth.py."""

from __future__ import annotations

import httpx
import pytest

from contract.json_depth import TOO_DEEP
from process.ports import free_port
from tests.support.redis_fixtures import redis_server  # noqa: F401

pytestmark = pytest.mark.timeout(300)


def nested(levels: int) -> str:
    """``levels`` levels of arrays and objects, alternating, around a number."""
    text = "1"
    for level in range(levels):
        text = f"[{text}]" if level % 2 else f'{{"k":{text}}}'
    return text


# where the nesting goes: (the body's JSON text with NEST for the nested value, the body's own levels around it)
PLACES = {
    "unknown_field": ('{"messages":[{"role":"user","content":"hi"}],"max_tokens":1,"extra":NEST}', 1),
    "messages": ('{"messages":NEST,"max_tokens":1}', 1),
    "content": ('{"messages":[{"role":"user","content":NEST}],"max_tokens":1}', 3),
    "content_part_text": ('{"messages":[{"role":"user","content":[{"type":"text","text":NEST}]}],"max_tokens":1}', 5),
    "model": ('{"messages":[{"role":"user","content":"hi"}],"model":NEST}', 1),
}
ENCODER_PLACES = {
    "images": ('{"room":1,"images":NEST}', 1),
    "unknown_field": ('{"room":1,"images":[],"extra":NEST}', 1),
    "image_data": ('{"room":1,"images":[{"data":NEST}]}', 3),
}


def body(place: tuple[str, int], depth: int) -> bytes:
    """The body of ``place`` nested ``depth`` levels deep in all."""
    template, around = place
    return template.replace("NEST", nested(depth - around)).encode()


def assert_too_deep(response: httpx.Response, stage: str) -> None:
    assert response.status_code == 400, response.text
    assert response.json() == {"error": {"message": TOO_DEEP, "type": "invalid_request_error", "param": None,
                                         "code": "invalid_json", "stage": stage}}


@pytest.fixture(scope="module")
def stages(start_server, tiny_model, redis_server):  # noqa: F811
    model = str(tiny_model("qwen2_vl"))
    return {"colocated": start_server("colocated", "--model", model, "--kv-cache-mib", "16"),
            "prefill": start_server("prefill", "--model", model, "--kv-cache-mib", "16",
                                    "--bootstrap-port", str(free_port())),
            "decode": start_server("decode", "--model", model, "--kv-cache-mib", "16"),
            "encoder": start_server("encoder", "--model", model, "--redis-url", redis_server.url)}


# --- real servers -------------------------------------------------------------------------------
@pytest.mark.parametrize("role", ["colocated", "prefill", "decode"])
@pytest.mark.parametrize("place", sorted(PLACES))
@pytest.mark.parametrize("depth", [65, 1000, 100_000])
def test_chat_bodies_nested_too_deep_are_refused(stages, role, place, depth):
    response = httpx.post(f"{stages[role].url}/v1/chat/completions", content=body(PLACES[place], depth),
                          headers={"content-type": "application/json"}, timeout=30)
    assert_too_deep(response, role)


@pytest.mark.parametrize("place", sorted(ENCODER_PLACES))
@pytest.mark.parametrize("depth", [65, 1000, 100_000])
def test_encoder_bodies_nested_too_deep_are_refused(stages, place, depth):
    response = httpx.post(f"{stages['encoder'].url}/v1/encode", content=body(ENCODER_PLACES[place], depth),
                          headers={"content-type": "application/json"}, timeout=30)
    assert_too_deep(response, "encoder")


def test_sixty_four_levels_and_brackets_in_text_are_served(stages):
    url = f"{stages['colocated'].url}/v1/chat/completions"
    deepest = body(PLACES["unknown_field"], 64)
    answer = httpx.post(url, content=deepest, headers={"content-type": "application/json"}, timeout=60)
    assert answer.status_code == 200, answer.text
    text = httpx.post(url, json={"messages": [{"role": "user", "content": "[" * 300 + "{" * 300}], "max_tokens": 1},
                      timeout=60)
    assert text.status_code == 200, text.text
    # a known field at 64 levels is judged by the schema, not by the bound
    schema = httpx.post(url, content=body(PLACES["model"], 64), headers={"content-type": "application/json"},
                        timeout=30)
    assert schema.status_code == 400 and schema.json()["error"]["param"] == "model", schema.text


def test_every_stage_stays_healthy(stages):
    for server in stages.values():
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
