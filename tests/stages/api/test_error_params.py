"""Errors name what the client sent, every error has a code, and OpenAI's own spellings work.

Unit (pure): every construction of an error in ``stages/``, ``router/`` and ``cache/`` gives a
``code``; the framework's own errors get one; a stage's ``param`` maps back to the client's path in
epd mode.
Real servers: a colocated server, and an epd router (private Redis, an encoder, a prefill and a
decode over Mooncake): a truncated image, one over the pixel limit and one of an aspect ratio the
model refuses are refused naming ``messages[0].content[i].image_url`` (what the client sent, not the
encoder's ``images[0]`` nor the ``image_ref`` the router made of it), with a code; ``top_p: 0`` and
role ``developer`` answer as ``top_p`` 1e-6 and role ``system`` do.
"""

from __future__ import annotations

import ast
import io
import struct
import zlib
from pathlib import Path

import httpx
import pytest
from PIL import Image

from cache.config import MIB
from cache.embedded import EmbeddedRedis
from router.dispatch.client_params import as_client_sees, client_param
from router.plan.image_refs import RefImage, encode_body
from router.plan.modes import Target
from router.dispatch.verdict import Failure
from tests.conftest import REPO
from tests.support.epd_helpers import start_epd
from tests.support.router_helpers import data_url, png
from tests.support.stage_api import FakeAsyncEngine, client_for

pytestmark = pytest.mark.timeout(300)
MAX_PIXELS = 1_000_000
# each error constructor -> (position of its code argument, or None: keyword only)
CODE_ARGUMENT = {"APIError": None, "RouterError": None, "DisaggError": 2, "bad_request": 2, "too_large": 2,
                 "error_body": 2, "ImageRefused": 1}
ROOTS = ("stages", "router", "cache")  # cache: the image refusals of ``cache.image_bytes``


# --- every error has a code --------------------------------------------------------------------
def _constructions(root: Path):
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call):
                name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
                if name in CODE_ARGUMENT:
                    yield f"{path.relative_to(REPO)}:{node.lineno}", name, node


def _code_of(name: str, call: ast.Call) -> ast.expr | None:
    given = next((k.value for k in call.keywords if k.arg == "code"), None)
    position = CODE_ARGUMENT[name]
    if given is None and position is not None and len(call.args) > position:
        given = call.args[position]
    return given


def _may_be_none(code: ast.expr | None) -> bool:
    if code is None or (isinstance(code, ast.Constant) and code.value is None):
        return True
    if isinstance(code, ast.IfExp):
        return _may_be_none(code.body) or _may_be_none(code.orelse)
    return False


def test_every_error_construction_gives_a_code():
    """No error body leaves with ``code: null``: each construction names one (a variable passed on,
    as the helpers do, counts: its own callers are checked here too)."""
    found = [(where, name) for root in ROOTS for where, name, call in _constructions(REPO / root)
             if _may_be_none(_code_of(name, call))]
    assert found == []
    assert sum(1 for root in ROOTS for _ in _constructions(REPO / root)) > 100  # the scan sees them


@pytest.mark.unit
def test_the_frameworks_own_errors_have_a_code():
    client = client_for(FakeAsyncEngine())
    for response, status, code in ((client.get("/nope"), 404, "not_found"),
                                   (client.get("/v1/chat/completions"), 405, "method_not_allowed"),
                                   (client.post("/v1/chat/completions", json={}), 400, "missing_required_parameter")):
        assert response.status_code == status and response.json()["error"]["code"] == code


# --- the client's path (pure) ------------------------------------------------------------------------
def _ref(key: str, i: int, j: int) -> RefImage:
    return RefImage({}, "data:,", key, 8, 8, f"messages[{i}].content[{j}].image_url")


IMAGES = [_ref("a" * 64, 0, 1), _ref("b" * 64, 2, 0), _ref("a" * 64, 2, 3)]


@pytest.mark.parametrize("param, stage, encoded, expected", [
    ("messages[0].content[1].image_ref", "decode", [], "messages[0].content[1].image_url"),
    ("messages[2].content[0].image_ref.width", "prefill", [], "messages[2].content[0].image_url"),
    ("messages[2].content[0].image_refs", "prefill", [], "messages[2].content[0].image_refs"),  # not a ref part
    ("messages[1].content[0]", "decode", [], "messages[1].content[0]"),
    ("top_p", "decode", [], "top_p"),
    ("images[0]", "encoder", ["b" * 64, "a" * 64], "messages[2].content[0].image_url"),
    ("images[1].key", "encoder", ["b" * 64, "a" * 64], "messages[0].content[1].image_url"),  # its first part
    ("images[2]", "encoder", ["b" * 64], None),
    ("images", "encoder", ["b" * 64], "messages"),
    ("room", "encoder", ["b" * 64], None),
])
def test_a_stage_param_is_mapped_to_the_clients_path(param, stage, encoded, expected):
    assert client_param(param, stage, IMAGES, encoded) == expected


@pytest.mark.unit
def test_the_forwarded_body_changes_only_in_its_param():
    worker = type("W", (), {"url": "http://e:1"})()
    targets = [Target("encoder", worker, encode_body(7, [IMAGES[1], IMAGES[0]]), "/v1/encode")]
    raw = b'{"error":{"message":"bad","type":"invalid_request_error","param":"images[1]","code":"invalid_image"}}'
    seen = as_client_sees(Failure("encoder", "http://e:1", 400, "bad", "invalid_image", raw), IMAGES, targets)
    assert httpx.Response(400, content=seen.raw).json() == {"error": {
        "message": "bad", "type": "invalid_request_error", "param": "messages[0].content[1].image_url",
        "code": "invalid_image"}}
    unmapped = Failure("decode", "http://d:1", 400, "bad", "invalid_value", raw.replace(b"images[1]", b"top_p"))
    assert as_client_sees(unmapped, IMAGES, targets) is unmapped


# --- real servers ----------------------------------------------------------------------------------
def header_only_png(width: int, height: int) -> bytes:
    """A PNG claiming width x height, with no pixel data: its size is read from the header alone."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)) + \
        chunk(b"IEND", b"")


def solid_png(width: int, height: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (9, 99, 199)).save(buffer, format="PNG")
    return buffer.getvalue()


def truncated_png() -> bytes:
    whole = png(64, 64, 5)
    return whole[:len(whole) // 2]  # the header is whole; the pixel data stops halfway


BAD_IMAGES = {  # name -> (file, status, code, the message's start)
    "truncated": (truncated_png(), 400, "invalid_image", "The image could not be decoded"),
    "over the pixel limit": (header_only_png(2000, 1000), 413, "image_too_large", "The image is 2000x1000"),
    "aspect ratio over 200": (solid_png(402, 2), 400, "invalid_image", "The image"),
}


def chat(content: list | str, **fields) -> dict:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 6, "temperature": 0,
            "ignore_eos": True, **fields}


def with_image(data: bytes) -> dict:
    return chat([{"type": "text", "text": "what is it"}, {"type": "image_url", "image_url": {"url": data_url(data)}}])


@pytest.fixture(scope="module")
def model(tiny_model):
    return str(tiny_model("qwen2_vl"))


@pytest.fixture(scope="module")
def colocated(start_server, model):
    return start_server("colocated", "--model", model, "--kv-cache-mib", "16", "--max-image-pixels", str(MAX_PIXELS))


@pytest.fixture(scope="module")
def epd_router(start_server, tmp_path_factory):
    redis = EmbeddedRedis(64 * MIB).start()
    limits = ("--max-image-pixels", str(MAX_PIXELS))
    epd = start_epd("qwen2_vl", "mooncake", redis.url, tmp_path_factory.mktemp("epd-logs"), encoder_flags=limits,
                    prefill_flags=("--pair-timeout-s", "5", *limits), decode_flags=("--kv-timeout-s", "15", *limits))
    try:
        yield start_server("router", "--encoder", epd.encoders[0].url, "--prefill", epd.prefill.url, "--decode",
                           epd.decode.url, "--redis-url", redis.url, "--upstream-timeout-s", "30")
    finally:
        epd.stop()
        redis.stop()


def post(server, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)


@pytest.mark.parametrize("where", ["colocated", "epd_router"])
@pytest.mark.parametrize("case", sorted(BAD_IMAGES))
def test_a_bad_image_is_refused_naming_the_part_the_client_sent(request, where, case):
    server = request.getfixturevalue(where)
    data, status, code, says = BAD_IMAGES[case]
    response = post(server, with_image(data))
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"]) == ("messages[0].content[1].image_url", code), error
    assert error["message"].startswith(says) and error["type"] == "invalid_request_error", error
    if case == "aspect ratio over 200":  # the encoder's or a text stage's words, whichever answers first
        assert "absolute aspect ratio must be smaller than 200, got 201.0" in error["message"], error


@pytest.mark.parametrize("where", ["colocated", "epd_router"])
def test_openai_spellings_answer_as_their_equivalents(request, where):
    server = request.getfixturevalue(where)
    image = {"type": "image_url", "image_url": {"url": data_url(png(48, 32, 3))}}
    system = {"messages": [{"role": "system", "content": "Answer briefly."},
                           {"role": "user", "content": [image, {"type": "text", "text": "what is it"}]}],
              "max_tokens": 6, "ignore_eos": True, "seed": 11}
    developer = {**system, "messages": [{**system["messages"][0], "role": "developer"}, system["messages"][1]]}
    answers = [post(server, body) for body in (system, developer, {**system, "top_p": 1e-6},
                                               {**developer, "top_p": 0})]
    assert [a.status_code for a in answers] == [200] * 4, [a.text for a in answers]
    texts = [a.json()["choices"][0]["message"]["content"] for a in answers]
    usage = [{k: v for k, v in a.json()["usage"].items() if k != "prompt_tokens_details"} for a in answers]  # later ones hit the cache
    assert texts[0] == texts[1] and texts[2] == texts[3] and usage[0] == usage[1] == usage[2] == usage[3]
