"""Hub-layout checkpoints (``stage make-model --hub-layout``) served by real stage servers with the
default flags (but a small KV pool), one stack per mode, each answer token for token Hugging Face
generate() on the same directory, in the dtype a server resolves there (``--dtype auto``):

    colocated  Qwen2.5-VL  flat config.json, chat_template.json, min_pixels/max_pixels only
    PD         LLaVA-1.5   language_model.* shard keys, chat_template.jinja (prefill and decode over Mooncake)
    EPD        Qwen3-VL    deepstack features from E through Redis to P, the halves loaded from the shards

Every family is checked against generate() in process (tests/stages/engine/test_hub_parity.py); this
file shows the servers load and serve the layout in each mode. The three stacks start together."""

from __future__ import annotations

import functools
import io
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from PIL import Image as PILImage

from process.ports import free_port
from stages.engine.config import EngineConfig
from stages.engine.models import load_adapter
from stages.engine.models.base import ModelAdapter
from stages.prompt import PromptBuilder
from tests.conftest import launch
from tests.support.devices import DEVICE
from tests.support.epd_helpers import Image, start_epd
from tests.support.generated_models import model_dir
from tests.support.hf_reference import hf_greedy, random_image
from tests.support.pd_pair import png_url, run_room
from tests.support.redis_fixtures import redis_server  # noqa: F401

pytestmark = pytest.mark.timeout(300)
STEPS = 10
KV = ["--kv-cache-mib", "16"]
CASES = {"text": ("hello, who are you?", []), "two_images": ("compare them", [(64, 64), (96, 128)])}


@functools.cache
def reference(path: Path) -> tuple[ModelAdapter, PromptBuilder]:
    """The whole model at ``path`` in the dtype its servers resolve here, and its prompt builder."""
    adapter = load_adapter(path, EngineConfig(model=str(path), device=DEVICE).torch_dtype, "sdpa", device=DEVICE)
    return adapter, PromptBuilder.load(path, adapter)


def generate(path: Path, text: str, images: list) -> tuple[list[int], str]:
    """generate()'s greedy tokens for ``text`` after ``images`` on ``path``, and their text."""
    adapter, builder = reference(path)
    parts = [*[{"type": "image"}] * len(images), {"type": "text", "text": text}]
    prompt = builder.build([{"role": "user", "content": parts}], images)
    tokens = hf_greedy(adapter.model, prompt, adapter.image_token_id, STEPS)
    return tokens, builder.tokenizer.decode(tokens, skip_special_tokens=True)


@pytest.fixture(scope="module")
def stacks(redis_server, tmp_path_factory):  # noqa: F811
    """{"colocated": server, "pd": (prefill, decode, bootstrap port), "epd": EPD}, started at once."""
    logs = tmp_path_factory.mktemp("hub-stacks")
    bootstrap = free_port()
    pd_common = ["--model", str(model_dir("llava", hub=True)), "--transfer", "mooncake", *KV]
    jobs = {
        "colocated": lambda: launch("colocated", ["--model", str(model_dir("qwen2_5_vl", hub=True)), *KV],
                                    logs / "colocated.log", 180.0),
        "prefill": lambda: launch("prefill", [*pd_common, "--bootstrap-port", str(bootstrap)], logs / "prefill.log", 180.0),
        "decode": lambda: launch("decode", pd_common, logs / "decode.log", 180.0),
        "epd": lambda: start_epd("qwen3_vl", "mooncake", redis_server.url, logs, path=model_dir("qwen3_vl", hub=True)),
    }
    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = {name: pool.submit(job) for name, job in jobs.items()}
        started = {name: f.result() for name, f in futures.items()}
    yield {"colocated": started["colocated"], "pd": (started["prefill"], started["decode"], bootstrap),
           "epd": started["epd"]}
    for name in ("colocated", "prefill", "decode", "epd"):
        started[name].stop()


@pytest.mark.parametrize("case", sorted(CASES))
def test_colocated_qwen2_5_vl(stacks, case):
    text, sizes = CASES[case]
    parts = [{"type": "image_url", "image_url": {"url": png_url(w, h, i)}} for i, (w, h) in enumerate(sizes)]
    body = {"messages": [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}],
            "max_tokens": STEPS, "temperature": 0}
    answer = httpx.post(f"{stacks['colocated'].url}/v1/chat/completions", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    tokens, expected = generate(model_dir("qwen2_5_vl", hub=True), text,
                                [random_image(w, h, i) for i, (w, h) in enumerate(sizes)])
    assert answer.json()["choices"][0]["message"]["content"] == expected
    assert answer.json()["usage"]["completion_tokens"] == len(tokens)


@pytest.mark.parametrize("case", sorted(CASES))
async def test_pd_llava(stacks, case):
    prefill, decode, bootstrap = stacks["pd"]
    text, sizes = CASES[case]
    _, d = await run_room(prefill, decode, bootstrap, text, sizes, STEPS)
    tokens, expected = generate(model_dir("llava", hub=True), text,
                                [random_image(w, h, i) for i, (w, h) in enumerate(sizes)])
    assert d.json()["choices"][0]["message"]["content"] == expected
    assert d.json()["usage"]["completion_tokens"] == len(tokens)


@pytest.mark.parametrize("case", sorted(CASES))
async def test_epd_qwen3_vl(stacks, case):
    epd = stacks["epd"]
    text, sizes = CASES[case]
    images = [Image.random(w, h, seed=20 + i) for i, (w, h) in enumerate(sizes)]
    async with httpx.AsyncClient(timeout=60) as client:
        answers = await epd.run(client, images, text, max_tokens=STEPS)
    assert all(r.status_code == 200 for r in answers.encode), [r.text for r in answers.encode]
    tokens, expected = generate(epd.path, text, [PILImage.open(io.BytesIO(im.data)) for im in images])
    assert answers.text == expected
    assert answers.decode.json()["usage"]["completion_tokens"] == len(tokens)
    encoder, prefill, decode = (epd.info(s) for s in (epd.encoders[0].server, epd.prefill, epd.decode))
    assert (prefill["parts"], decode["parts"]) == (["text"], ["text"])  # the halves, read from the shards
    full = reference(epd.path)[0].num_parameters
    assert 0 < encoder["num_parameters"] < full and encoder["num_parameters"] + prefill["num_parameters"] == full
