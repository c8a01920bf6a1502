"""KV on demand in the engine: a pool sized for 3 requests at their longest serves 8 concurrent ones,
preempting (recompute) the most recently admitted when it runs dry, with exactly the tokens a pool
that never runs dry gives, images and M-RoPE included; a seeded sampled request preempted on the
way draws the same tokens (its generator survives); a decode's request is swapped to the host and
back, bit for bit.

On ``EPD_TEST_DEVICE`` (tests/support/devices.py); the CPU compares exactly, a GPU up to a near tie
(a recompute's prefill is a different kernel shape from the decodes it replaces)."""

from __future__ import annotations

import pytest

from stages.engine.block_allocator import blocks_for_tokens
from stages.engine.config import EngineConfig
from stages.engine.engine import Engine
from stages.engine.request import Preemption, Request
from stages.engine.sampling_params import SamplingParams
from stages.loading import load_engine
from stages.metrics import PREEMPTION_KINDS
from tests.support.devices import DEVICE, on_gpu
from tests.support.generated_models import model_dir
from tests.support.hf_reference import random_image

MAX_TOKENS = 560  # prompt + 559 slots: 38-41 blocks of 16, so the 128-block pool (1 MiB) holds 3 at their longest
SMALL_MIB, BIG_MIB = 1, 8
# (images' sizes, words): text and image prompts of different lengths
PROMPTS = [([], 3), ([(64, 64)], 2), ([], 9), ([(96, 64)], 1), ([], 5), ([(64, 64), (32, 48)], 1), ([], 1),
           ([(64, 96)], 4)]
SEEDED = len(PROMPTS) - 1  # the last admitted: the first preempted


def params(index: int) -> SamplingParams:
    if index == SEEDED:
        return SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def build(builder, index: int):
    sizes, words = PROMPTS[index]
    images = [random_image(w, h, seed=index * 10 + i) for i, (w, h) in enumerate(sizes)]
    parts = [{"type": "image"} for _ in images] + [{"type": "text", "text": "tell me about it " * words}]
    return builder.build([{"role": "user", "content": parts}], images)


def run_all(engine: Engine, builder, tag: str) -> tuple[list[Request], dict[str, str]]:
    """The 8 requests added at once and stepped to the end (bounded); each request and its text."""
    requests = [engine.add_request(f"{tag}-{i}", build(builder, i), params(i)) for i in range(len(PROMPTS))]
    texts = {r.request_id: "" for r in requests}
    for _ in range(20 * MAX_TOKENS):
        if not engine.has_work():
            break
        for output in engine.step():
            assert output.error is None, output.error
            texts[output.request_id] += output.text
    assert not engine.has_work() and engine.allocator.num_used == 0
    return requests, texts


@pytest.fixture(scope="module", params=["qwen3_vl", "llava"])
def runs(request):
    path = str(model_dir(request.param))
    small, builder = load_engine(EngineConfig(model=path, kv_cache_mib=SMALL_MIB, device=DEVICE), pixels=True)
    big, _ = load_engine(EngineConfig(model=path, kv_cache_mib=BIG_MIB, device=DEVICE), pixels=True)
    return small, run_all(small, builder, "small"), run_all(big, builder, "big")


def test_the_small_pool_holds_three_requests_at_their_longest(runs):
    small, (requests, _), _ = runs
    longest = [blocks_for_tokens(r.max_total_tokens, small.allocator.block_size) for r in requests]
    assert small.allocator.num_blocks == 128 and 3 * max(longest) <= 128 < 4 * min(longest)


def test_eight_concurrent_requests_match_a_pool_that_never_runs_dry(runs):
    small, (preempted, texts), (reference, reference_texts) = runs
    assert small.scheduler.preemptions["recompute"] >= len(PROMPTS) - 3 and small.scheduler.preemptions["swap"] == 0
    assert sum(r.num_preemptions > 0 for r in preempted) >= len(PROMPTS) - 3
    assert all(r.num_preemptions == 0 for r in reference)
    for i, (got, expected) in enumerate(zip(preempted, reference)):
        if i == SEEDED:
            continue
        assert len(got.output_ids) == MAX_TOKENS
        if on_gpu():  # a near tie may part them; the first tokens, before any preemption, agree
            assert got.output_ids[:8] == expected.output_ids[:8]
        else:
            assert got.output_ids == expected.output_ids, f"request {i} (preempted {got.num_preemptions} times)"


def test_a_seeded_request_preempted_on_the_way_draws_the_same_tokens(runs):
    _, (preempted, texts), (reference, reference_texts) = runs
    got, expected = preempted[SEEDED], reference[SEEDED]
    assert got.num_preemptions > 0 and len(got.output_ids) == MAX_TOKENS
    if not on_gpu():
        assert got.output_ids == expected.output_ids
        assert texts[got.request_id] == reference_texts[expected.request_id]
    assert len(set(got.output_ids)) > 20  # sampled, not a greedy loop: the negative control of the seed


@pytest.mark.unit
def test_the_metric_labels_are_the_preemption_kinds_and_the_flag_is_checked():
    assert PREEMPTION_KINDS == tuple(kind.value for kind in Preemption)
    with pytest.raises(ValueError, match=r"--kv-allocation must be one of \['on_demand', 'reserve'\], got 'lazy'"):
        EngineConfig(model="m", kv_allocation="lazy")


def test_a_recompute_that_finds_its_prefix_evicted_encodes_the_image_it_skipped():
    """B's first admission hits the cached prefix of an earlier run of its prompt, image included (not
    encoded: a stand-in). B, the newest, is preempted; C's growth evicts that prefix before B comes
    back, so the recompute must encode the image after all, and B answers as if nothing happened."""
    path = str(model_dir("qwen3_vl"))
    small, builder = load_engine(EngineConfig(model=path, kv_cache_mib=SMALL_MIB, device=DEVICE), pixels=True)
    big, _ = load_engine(EngineConfig(model=path, kv_cache_mib=BIG_MIB, device=DEVICE), pixels=True)

    def chat():
        prompt = build(builder, 1)  # its image first
        prompt.image_keys = ["0" * 64]
        return prompt

    greedy = SamplingParams(max_tokens=1200, temperature=0.0, ignore_eos=True)
    small.add_request("warm", chat(), SamplingParams(max_tokens=1, temperature=0.0))
    small.step()
    c_prompt = build(builder, 6)
    small.add_request("c", c_prompt, SamplingParams(max_tokens=small.max_model_len - len(c_prompt.token_ids),
                                                    temperature=0.0, ignore_eos=True))
    small.step()
    b = small.add_request("b", chat(), greedy)
    small.step()
    assert b.num_cached_tokens > 0 and b.prompt.embeddings is not None and b.prompt.embeddings[0].stand_in
    for _ in range(10 * small.max_model_len):
        if not small.has_work():
            break
        small.step()
    assert not small.has_work() and small.allocator.num_used == 0
    assert b.num_preemptions > 0 and b.prompt.embeddings is not None and not b.prompt.embeddings[0].stand_in
    reference = big.add_request("b", chat(), greedy)
    for _ in range(2 * greedy.max_tokens):
        if not big.has_work():
            break
        big.step()
    if not on_gpu():
        assert b.output_ids == reference.output_ids
