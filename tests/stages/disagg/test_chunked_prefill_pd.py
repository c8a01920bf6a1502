"""Chunked prefill on the prefill side of 1P1D: a prefill server started with a small
``--max-batched-tokens`` computes each prompt in chunks and hands the whole prompt's KV to the decode
server only then; the decode's answer equals Hugging Face generate() token for token."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from stages.engine.models import load_adapter
from process.ports import free_port
from stages.prompt import PromptBuilder
from tests.conftest import launch
from tests.support.devices import DEVICE
from tests.support.generated_models import model_dir
from tests.support.hf_reference import hf_greedy, random_image
from tests.support.pd_pair import run_room, wait_blocks_free

pytestmark = pytest.mark.timeout(300)
STEPS = 10
BUDGET = 16
VARIANT = "qwen3_vl"  # M-RoPE and deepstack: the most a chunk boundary can cut


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    path = str(model_dir(VARIANT))
    bootstrap = free_port()
    logs = tmp_path_factory.mktemp("pd-chunked")
    common = ["--model", path, "--transfer", "mooncake", "--kv-cache-mib", "16"]
    with ThreadPoolExecutor(2) as pool:
        prefill, decode = pool.map(lambda job: launch(*job), [
            ("prefill", [*common, "--bootstrap-port", str(bootstrap), "--max-batched-tokens", str(BUDGET)],
             logs / "prefill.log", 180.0, None),
            ("decode", common, logs / "decode.log", 180.0, None),
        ])
    yield path, prefill, decode, bootstrap
    prefill.stop()
    decode.stop()


@pytest.mark.parametrize("sizes", [[], [(128, 128), (64, 64)]], ids=["text", "two_images"])
async def test_decode_answer_equals_generate_with_a_chunked_prefill(pair, sizes):
    path, prefill, decode, bootstrap = pair
    text = "describe every detail you can see " * 4
    p, d = await run_room(prefill, decode, bootstrap, text, sizes, STEPS)

    adapter = load_adapter(path, torch.float32, "sdpa", device=DEVICE)
    prompts = PromptBuilder.load(path, adapter)
    images = [random_image(w, h, i) for i, (w, h) in enumerate(sizes)]
    prompt = prompts.build([{"role": "user", "content": [{"type": "image"} for _ in images]
                             + [{"type": "text", "text": text}]}], images)
    assert len(prompt.token_ids) > 3 * BUDGET  # the prefill took several chunks
    expected = hf_greedy(adapter.model, prompt, adapter.image_token_id, STEPS)
    answer = d.json()
    assert answer["usage"]["prompt_tokens"] == len(prompt.token_ids)
    assert answer["choices"][0]["message"]["content"] == prompts.tokenizer.decode(expected, skip_special_tokens=True)
    await asyncio.to_thread(wait_blocks_free, prefill, decode)  # bounded: 10 s
