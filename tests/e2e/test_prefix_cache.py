"""Prefix caching through the servers: a two-turn chat about one image, colocated, 1P1D and 1E1P1D.
The second turn hits exactly the first turn's full blocks it shares; its answer equals Hugging Face
generate() token for token (so prefix caching changes nothing but the work done); the hit reaches
the client as ``usage.prompt_tokens_details.cached_tokens`` (streamed and not; in PD and EPD from
the prefill, through the decode); the decode's own cache holds the first turn's blocks, so only the
blocks after them travel; /metrics counts it; blocks in use come back to 0. A colocated server and a
PD prefill neither decode nor preprocess the image a later turn's hit covers
(``epd_images_preprocess_skipped_total``), and still answer exactly."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import random
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from PIL import Image as PILImage
from prometheus_client.parser import text_string_to_metric_families

from stages.engine.models import load_adapter
from process.ports import free_port
from stages.prompt import PromptBuilder
from tests.conftest import launch
from tests.support.devices import DEVICE
from tests.support.epd_helpers import Image, start_epd
from tests.support.generated_models import model_dir
from tests.support.hf_reference import hf_greedy
from tests.support.pd_pair import wait_blocks_free
from tests.support.redis_fixtures import redis_server  # noqa: F401

pytestmark = pytest.mark.timeout(300)
VARIANT = "qwen3_vl"  # M-RoPE and deepstack
STEPS = 6
BLOCK = 16  # the servers' --block-size (default)
IMAGE = Image.random(96, 96, seed=5)
IMAGE_URL = "data:image/png;base64," + base64.b64encode(IMAGE.data).decode()
TURN_1 = "describe this picture in every detail you can"
TURN_2 = "and what colors are in it?"


@pytest.fixture(scope="module")
def reference():
    path = str(model_dir(VARIANT))
    adapter = load_adapter(path, torch.float32, "sdpa", device=DEVICE)
    return adapter, PromptBuilder.load(path, adapter)


def messages(image_part: dict, answer: str | None) -> list[dict]:
    """Turn 1 (``answer`` None), or turn 2 after ``answer``."""
    chat = [{"role": "user", "content": [image_part, {"type": "text", "text": TURN_1}]}]
    if answer is not None:
        chat += [{"role": "assistant", "content": answer}, {"role": "user", "content": TURN_2}]
    return chat


def expected(reference, answer: str | None) -> tuple[list[int], list[int]]:
    """The prompt's token ids and generate()'s greedy tokens."""
    adapter, prompts = reference
    pixels = PILImage.open(io.BytesIO(IMAGE.data))
    prompt = prompts.build(messages({"type": "image"}, answer), [pixels])
    return prompt.token_ids, hf_greedy(adapter.model, prompt, adapter.image_token_id, STEPS)


def hit(earlier: list[int], later: list[int]) -> int:
    """Tokens ``later`` finds cached after ``earlier`` ran: the full blocks both share, within len - 1."""
    same = next((i for i, (a, b) in enumerate(zip(earlier, later)) if a != b), min(len(earlier), len(later)))
    return min(same // BLOCK, len(earlier) // BLOCK, (len(later) - 1) // BLOCK) * BLOCK


def metric_values(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}


def stream_usage(response: httpx.Response) -> dict:
    events = [line[len("data: "):] for line in response.text.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return json.loads(events[-2])["usage"]


def body(image_part: dict, answer: str | None, **extra) -> dict:
    return {"messages": messages(image_part, answer), "max_tokens": STEPS, "temperature": 0, **extra}


def check_turns(reference, first: dict, second: dict) -> None:
    """Both answers equal generate(); the second turn's usage reports exactly the shared blocks."""
    ids_1, tokens_1 = expected(reference, None)
    tokenizer = reference[1].tokenizer
    assert first["choices"][0]["message"]["content"] == tokenizer.decode(tokens_1, skip_special_tokens=True)
    answer = first["choices"][0]["message"]["content"]
    ids_2, tokens_2 = expected(reference, answer)
    assert second["choices"][0]["message"]["content"] == tokenizer.decode(tokens_2, skip_special_tokens=True)
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert second["usage"] == {"prompt_tokens": len(ids_2), "completion_tokens": STEPS,
                               "total_tokens": len(ids_2) + STEPS,
                               "prompt_tokens_details": {"cached_tokens": hit(ids_1, ids_2)}}
    assert hit(ids_1, ids_2) > len(ids_1) // 2  # past the image: the hit is most of the first turn


# --- colocated ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def colocated(tmp_path_factory):
    server = launch("colocated", ["--model", str(model_dir(VARIANT)), "--kv-cache-mib", "16"],
                    tmp_path_factory.mktemp("prefix-colocated") / "colocated.log", 180.0)
    yield server
    server.stop()


def test_colocated_second_turn_hits_the_first(colocated, reference):
    part = {"type": "image_url", "image_url": {"url": IMAGE_URL}}
    with httpx.Client(base_url=colocated.url, timeout=60) as http:
        first = http.post("/v1/chat/completions", json=body(part, None)).json()
        second = http.post("/v1/chat/completions", json=body(part, first["choices"][0]["message"]["content"])).json()
        check_turns(reference, first, second)
        streamed = http.post("/v1/chat/completions", json=body(part, first["choices"][0]["message"]["content"],
                                                                 stream=True, stream_options={"include_usage": True}))
    ids_2 = expected(reference, first["choices"][0]["message"]["content"])[0]
    again = (len(ids_2) - 1) // BLOCK * BLOCK  # the same prompt again: every full block but the last token's
    assert stream_usage(streamed)["prompt_tokens_details"] == {"cached_tokens": again}
    values = metric_values(colocated.url)
    ids_1 = expected(reference, None)[0]
    assert values["epd_prefix_cache_queries_total"] == len(ids_1) + 2 * len(ids_2)
    assert values["epd_prefix_cache_hit_tokens_total"] == second["usage"]["prompt_tokens_details"]["cached_tokens"] + again
    assert values["epd_kv_blocks_used"] == 0 and values["epd_kv_blocks_cached"] >= len(ids_2) // BLOCK
    assert values["epd_images_preprocess_skipped_total"] == 2  # turn 2's image, twice: covered by the hit
    assert info(colocated)["kv_blocks"]["cached"] == values["epd_kv_blocks_cached"]


# --- 1P1D -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pd_pair(tmp_path_factory):
    path, bootstrap = str(model_dir(VARIANT)), free_port()
    logs = tmp_path_factory.mktemp("prefix-pd")
    common = ["--model", path, "--transfer", "mooncake", "--kv-cache-mib", "16"]
    with ThreadPoolExecutor(2) as pool:
        prefill, decode = pool.map(lambda job: launch(*job), [
            ("prefill", [*common, "--bootstrap-port", str(bootstrap)], logs / "prefill.log", 180.0, None),
            ("decode", common, logs / "decode.log", 180.0, None)])
    yield prefill, decode, bootstrap
    prefill.stop()
    decode.stop()


async def room(prefill, decode, request: dict) -> tuple[dict, dict]:
    async with httpx.AsyncClient(timeout=60) as client:
        p, d = await asyncio.gather(client.post(f"{prefill.url}/v1/chat/completions", json=request),
                                    client.post(f"{decode.url}/v1/chat/completions", json=request))
    assert p.status_code == d.status_code == 200, (p.text, d.text)
    return p.json(), d.json()


async def test_pd_second_turn_hits_on_the_prefill_and_the_decode_reports_it(pd_pair, reference):
    prefill, decode, bootstrap = pd_pair
    part = {"type": "image_url", "image_url": {"url": IMAGE_URL}}

    def routed(answer: str | None) -> dict:
        return body(part, answer, bootstrap_host="127.0.0.1", bootstrap_port=bootstrap,
                    bootstrap_room=random.getrandbits(63))

    _, first = await room(prefill, decode, routed(None))
    moved = info(prefill)["transfer"]["bytes"]
    p, second = await room(prefill, decode, routed(first["choices"][0]["message"]["content"]))
    check_turns(reference, first, second)
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert p["usage"]["prompt_tokens_details"] == {"cached_tokens": cached}  # the prefill's own answer
    await asyncio.to_thread(wait_blocks_free, prefill, decode)
    assert metric_values(prefill.url)["epd_prefix_cache_hit_tokens_total"] == cached
    # the decode's own prefix cache holds turn 1's blocks too: only the blocks after them travel
    assert metric_values(decode.url)["epd_prefix_cache_hit_tokens_total"] == cached
    block_bytes = info(prefill)["fingerprint"]["block_bytes"]
    prompt_blocks = -(-second["usage"]["prompt_tokens"] // BLOCK)
    assert info(prefill)["transfer"]["bytes"] - moved == (prompt_blocks - cached // BLOCK) * block_bytes
    assert metric_values(decode.url)["epd_kv_blocks_cached"] > 0
    assert metric_values(prefill.url)["epd_images_preprocess_skipped_total"] == 1  # turn 2's image: covered
    assert metric_values(decode.url)["epd_images_preprocess_skipped_total"] == 0  # a decode takes sizes only


def info(server) -> dict:
    return httpx.get(f"{server.url}/server_info", timeout=10).json()


# --- 1E1P1D ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def epd(redis_server, tmp_path_factory):  # noqa: F811
    stack = start_epd(VARIANT, "mooncake", redis_server.url, tmp_path_factory.mktemp("prefix-epd"))
    yield stack
    stack.stop()


async def test_epd_second_turn_hits_by_the_image_refs_key(epd, reference):
    ref = {"type": "image_ref", "image_ref": {"key": epd.key(IMAGE), "width": IMAGE.width, "height": IMAGE.height}}
    async with httpx.AsyncClient(timeout=60) as client:
        await epd.claim([IMAGE], epd.encoders[0])
        encoded = await epd.encode(client, [IMAGE], epd.encoders[0], room=random.getrandbits(63))
        assert encoded.status_code == 200, encoded.text
        _, first = (r.json() for r in await epd.chat(client, epd_body(epd, ref, None)))
        _, second = (r.json() for r in await epd.chat(client, epd_body(epd, ref, first["choices"][0]["message"]["content"])))
    check_turns(reference, first, second)
    assert epd.blocks_used() == (0, 0)


def epd_body(epd, ref: dict, answer: str | None) -> dict:
    return body(ref, answer, bootstrap_host="127.0.0.1", bootstrap_port=epd.bootstrap_port,
                bootstrap_room=random.getrandbits(63))

