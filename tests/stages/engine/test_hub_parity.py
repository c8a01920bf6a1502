"""Every family's hub-layout checkpoint (``stage make-model --hub-layout``: bfloat16 shards, the chat
template in its own file, the repository's config and processor fields) served by the engine with the
default flags, token for token against Hugging Face generate() on the same directory, in process:

- colocated: one engine with both halves, prompts built from pixels;
- prefill/decode of PD and EPD: a text-only engine, prompts built from image sizes, embeddings from a
  vision-only adapter (the encoder's load), as an EPD prefill gets them from the cache.

generate() runs in the dtype the engine resolved for the checkpoint (``--dtype auto``: float32 on a CPU).
The servers themselves, one stack per mode: tests/e2e/test_hub_layout_stacks.py."""

from __future__ import annotations

import pytest
from transformers import AutoModelForImageTextToText

from stages.engine.config import EngineConfig
from stages.engine.models import load_adapter
from stages.engine.sampling_params import SamplingParams
from stages.loading import load_engine
from tests.support.devices import DEVICE
from tests.support.generated_models import model_dir
from tests.support.hf_reference import hf_greedy, random_image

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava")
STEPS = 12
CASES = {"text": ("Hello there, how are you today?", []), "one_image": ("Describe this picture.", [(64, 64)]),
         "two_images": ("compare them", [(64, 64), (96, 128)])}


def run(engine, request_id, prompt) -> list[int]:
    request = engine.add_request(request_id, prompt, SamplingParams(max_tokens=STEPS, temperature=0.0))
    for _ in range(STEPS + 2):
        if not engine.has_work():
            break
        engine.step()
    assert not engine.has_work() and engine.allocator.num_used == 0
    return request.output_ids


def messages(text: str, n_images: int) -> list[dict]:
    return [{"role": "user", "content": [*[{"type": "image"}] * n_images, {"type": "text", "text": text}]}]


@pytest.fixture(scope="module", params=FAMILIES)
def hub(request):
    """The checkpoint, its colocated engine and prompt builder, and generate()'s model in the engine's dtype."""
    path = model_dir(request.param, hub=True)
    engine, builder = load_engine(EngineConfig(model=str(path), kv_cache_mib=32, device=DEVICE), pixels=True)
    dtype = engine.adapter.model.dtype
    reference = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype).to(DEVICE).eval()
    return path, engine, builder, reference


@pytest.mark.parametrize("case", sorted(CASES))
def test_colocated_matches_generate(hub, case):
    _, engine, builder, reference = hub
    text, sizes = CASES[case]
    prompt = builder.build(messages(text, len(sizes)), [random_image(w, h, seed=i) for i, (w, h) in enumerate(sizes)])
    expected = hf_greedy(reference, prompt, engine.adapter.image_token_id, STEPS)
    assert run(engine, case, prompt) == expected


def test_text_half_fed_by_the_vision_half_matches_generate(hub):
    """The halves PD's decode and EPD's encoder, prefill and decode load, from the sharded checkpoint."""
    path, colocated, builder, reference = hub
    dtype = colocated.adapter.model.dtype
    text_engine, sizes_only = load_engine(EngineConfig(model=str(path), kv_cache_mib=16, device=DEVICE,
                                                       parts=("text",)), pixels=False)
    vision = load_adapter(path, dtype, "sdpa", parts=("vision",), device=DEVICE)
    assert text_engine.adapter.num_parameters + vision.num_parameters == colocated.adapter.num_parameters
    text, sizes = CASES["two_images"]
    images = [random_image(w, h, seed=i) for i, (w, h) in enumerate(sizes)]
    pixels = builder.build(messages(text, len(images)), images)
    prompt = sizes_only.build_from_sizes(messages(text, len(images)), [im.size for im in images])
    assert prompt.token_ids == pixels.token_ids
    prompt.embeddings = vision.encode(pixels.images)
    assert run(text_engine, "split", prompt) == hf_greedy(reference, pixels, vision.image_token_id, STEPS)
