"""The engine in-process, token for token against Hugging Face generate(), alone and batched.

On ``EPD_TEST_DEVICE`` (tests/support/devices.py). Single requests match generate() exactly everywhere; a
batched run matches the same requests run alone exactly on the CPU, and on a GPU up to a near tie
(``assert_same_or_near_tie``: batched kernels need not round as batch-1 kernels do)."""

from __future__ import annotations

import pytest

from stages.engine.config import EngineConfig
from stages.engine.engine import Engine
from stages.engine.sampling_params import SamplingParams
from stages.loading import load_engine
from tests.support.devices import DEVICE, assert_same_or_near_tie, on_gpu
from tests.support.generated_models import VARIANTS, model_dir
from tests.support.hf_reference import hf_greedy, hf_inputs, load_reference, random_image

STEPS = 12
CONVERSATIONS = {
    "text": ([{"type": "text", "text": "Hello there, how are you today?"}], []),
    "one_image": ([{"type": "image"}, {"type": "text", "text": "Describe this picture."}], [(64, 64)]),
    "two_images": (
        [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}, {"type": "text", "text": "compare"}],
        [(64, 64), (96, 128)],
    ),
}


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def run_alone(engine: Engine, request_id: str, prompt, params) -> list[int]:
    request = engine.add_request(request_id, prompt, params)
    for _ in range(params.max_tokens + 2):
        if not engine.has_work():
            break
        engine.step()
    assert not engine.has_work()
    return request.output_ids


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def engine_and_reference(request):
    path = model_dir(request.param)
    # a budget that holds the sixteen batched prompts of one test in one step (the per-device default may chunk them)
    engine, prompts = load_engine(EngineConfig(model=str(path), kv_cache_mib=32, device=DEVICE, max_batched_tokens=8192),
                                  pixels=True)
    return engine, prompts, load_reference(path)


@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
def test_greedy_matches_generate(engine_and_reference, conversation):
    engine, builder, reference = engine_and_reference
    parts, sizes = CONVERSATIONS[conversation]
    images = [random_image(w, h, seed=i) for i, (w, h) in enumerate(sizes)]
    prompt = builder.build([{"role": "user", "content": parts}], images)
    expected = hf_greedy(reference, prompt, engine.adapter.image_token_id, STEPS)
    # both stop at the end-of-sequence token (min_new_tokens would make generate() skip it instead)
    params = SamplingParams(max_tokens=STEPS, temperature=0.0)
    assert run_alone(engine, conversation, prompt, params) == expected
    assert engine.allocator.num_used == 0


def test_sixteen_batched_requests_match_one_at_a_time(engine_and_reference):
    engine, builder, reference = engine_and_reference
    prompts, params = [], []
    for i in range(16):
        images = [random_image(32 + 16 * ((i + k) % 5), 48 + 16 * (i % 4), seed=100 + i + k) for k in range(i % 3)]
        parts = [{"type": "image"}] * len(images) + [{"type": "text", "text": "word " * (3 * i + 1)}]
        prompts.append(lambda parts=parts, images=images: builder.build([{"role": "user", "content": parts}], images))
        params.append(greedy(6 + i % 5))
    alone = [run_alone(engine, f"alone-{i}", build(), p) for i, (build, p) in enumerate(zip(prompts, params))]
    batched = [engine.add_request(f"batch-{i}", build(), p) for i, (build, p) in enumerate(zip(prompts, params))]
    steps = 0
    while engine.has_work() and steps < 50:
        engine.step()
        steps += 1
    if on_gpu():
        for build, request, tokens in zip(prompts, batched, alone):
            assert_same_or_near_tie(reference, hf_inputs(build(), engine.adapter.image_token_id), tokens,
                                    request.output_ids)
    else:
        assert [r.output_ids for r in batched] == alone
    assert steps <= max(p.max_tokens for p in params) + 1  # they really ran together
    assert engine.allocator.num_used == 0
