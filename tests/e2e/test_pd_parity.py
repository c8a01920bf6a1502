"""1P1D greedy parity for every family over both real backends: the decode server's answer equals
Hugging Face generate() on the same checkpoint (and so colocated, which equals generate() in
test_engine_parity; test_pd_servers compares PD and a colocated server directly)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from stages.engine.models import load_adapter
from process.ports import free_port
from stages.prompt import PromptBuilder
from tests.conftest import launch
from tests.support.devices import DEVICE
from tests.support.generated_models import VARIANTS, model_dir
from tests.support.hf_reference import hf_greedy, random_image
from tests.support.pd_pair import run_room

pytestmark = pytest.mark.timeout(300)
STEPS = 10
CASES = {"text": ("hello, who are you?", []), "one_image": ("what is it", [(64, 64)]),
         "two_images": ("compare", [(64, 64), (96, 128)])}
PAIRS = [(variant, transfer) for variant in sorted(VARIANTS) for transfer in ("mooncake", "nixl")]


@pytest.fixture(scope="module", params=PAIRS, ids=[f"{v}-{t}" for v, t in PAIRS])
def pair(request, tmp_path_factory):
    variant, transfer = request.param
    path = str(model_dir(variant))
    bootstrap = free_port()
    logs = tmp_path_factory.mktemp(f"pd-{variant}-{transfer}")
    common = ["--model", path, "--transfer", transfer, "--kv-cache-mib", "16"]
    with ThreadPoolExecutor(2) as pool:  # start both at once: most of the wait is imports
        prefill, decode = pool.map(lambda job: launch(*job), [
            ("prefill", [*common, "--bootstrap-port", str(bootstrap)], logs / "prefill.log", 180.0, None),
            ("decode", common, logs / "decode.log", 180.0, None),
        ])
    yield path, prefill, decode, bootstrap
    prefill.stop()
    decode.stop()


@pytest.fixture(scope="module")
def reference(pair):
    path = pair[0]
    adapter = load_adapter(path, torch.float32, "sdpa", device=DEVICE)  # generate() on the servers' device
    prompts = PromptBuilder.load(path, adapter)
    return adapter, prompts.tokenizer, prompts


@pytest.mark.parametrize("case", sorted(CASES))
async def test_decode_answer_equals_generate(pair, reference, case):
    _, prefill, decode, bootstrap = pair
    adapter, tokenizer, prompts = reference
    text, sizes = CASES[case]
    p, d = await run_room(prefill, decode, bootstrap, text, sizes, STEPS)

    images = [random_image(w, h, i) for i, (w, h) in enumerate(sizes)]
    hf_parts = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
    prompt = prompts.build([{"role": "user", "content": hf_parts}], images)
    expected = hf_greedy(adapter.model, prompt, adapter.image_token_id, STEPS)
    answer = d.json()
    cached = answer["usage"].pop("prompt_tokens_details")["cached_tokens"]  # earlier cases may share a prefix
    assert answer["usage"] == {"prompt_tokens": len(prompt.token_ids), "completion_tokens": len(expected),
                               "total_tokens": len(prompt.token_ids) + len(expected)}
    assert cached % 16 == 0 and 0 <= cached < len(prompt.token_ids)  # whole blocks (--block-size 16), never all
    assert answer["choices"][0]["message"]["content"] == tokenizer.decode(expected, skip_special_tokens=True)
