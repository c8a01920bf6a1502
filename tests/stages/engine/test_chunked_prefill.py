"""Chunked prefill in the engine: prompts longer than ``--max-batched-tokens`` are computed a chunk
per step, images cut across chunk boundaries included, token for token as generate() and as the
engine with the whole prompt in one step. Decodes keep going while a long prompt is chunked, blocks
come back, and an abort mid-prompt frees them.

On ``EPD_TEST_DEVICE`` (tests/support/devices.py); the CPU compares exactly, a GPU up to a near tie
(a chunk's attention is a different kernel shape from the whole prompt's)."""

from __future__ import annotations

import pytest
import torch

from stages.engine.config import EngineConfig
from stages.engine.engine import Engine
from stages.engine.multimodal import ImageEmbedding, slice_embeddings
from stages.engine.sampling_params import SamplingParams
from stages.loading import load_engine
from tests.support.devices import DEVICE, assert_same_or_near_tie, on_gpu
from tests.support.generated_models import model_dir
from tests.support.hf_reference import hf_greedy, hf_inputs, load_reference, random_image

STEPS = 8
BUDGET = 16  # --max-batched-tokens of the chunked engine: every prompt below takes several chunks
WHOLE = 4096  # --max-batched-tokens of the reference engine: every prompt below is one step
# name -> (images' sizes, filler words): 0, 1 and 3 images
PROMPTS = {
    "text": ([], 40),
    "one_image": ([(128, 128)], 12),
    "three_images": ([(128, 128), (32, 48), (96, 64)], 6),
}


def greedy(max_tokens: int = STEPS) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def build(builder, name: str):
    sizes, words = PROMPTS[name]
    images = [random_image(w, h, seed=7 + i) for i, (w, h) in enumerate(sizes)]
    parts = []
    for _ in images:
        parts += [{"type": "image"}, {"type": "text", "text": "and"}]
    parts.append({"type": "text", "text": "describe the scene " * words})
    return builder.build([{"role": "user", "content": parts}], images)


def assert_same_tokens(reference, prompt, image_token: int, expected: list[int], got: list[int]) -> None:
    """``got`` == ``expected``; on a GPU, or parting from it only where the reference saw a near tie."""
    if on_gpu():
        assert_same_or_near_tie(reference, hf_inputs(prompt, image_token), expected, got)
    else:
        assert got == expected


def run_until_done(engine: Engine, max_steps: int = 200) -> int:
    """Step until the engine is idle; the number of steps taken (bounded)."""
    steps = 0
    while engine.has_work():
        assert steps < max_steps, "the engine did not finish within the bound"
        engine.step()
        steps += 1
    return steps


def image_cut_by_a_chunk(token_ids: list[int], image_token: int, budget: int) -> bool:
    """Some chunk boundary (every ``budget`` tokens of a prompt alone) falls inside a placeholder run."""
    return any(token_ids[cut - 1] == image_token == token_ids[cut] for cut in range(budget, len(token_ids), budget))


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen3_vl", "llava"])
def engines(request):
    path = model_dir(request.param)
    # prefix caching off: these count chunks from the prompt's start (tests/stages/engine/test_prefix_cache_engine.py has it on)
    chunked, builder = load_engine(EngineConfig(model=str(path), kv_cache_mib=32, device=DEVICE,
                                                max_batched_tokens=BUDGET, prefix_caching=False), pixels=True)
    whole, _ = load_engine(EngineConfig(model=str(path), kv_cache_mib=32, device=DEVICE, max_batched_tokens=WHOLE,
                                        prefix_caching=False),
                           pixels=True)
    return chunked, whole, builder, load_reference(path)


@pytest.mark.parametrize("name", sorted(PROMPTS))
def test_chunked_greedy_matches_generate_and_the_whole_prompt(engines, name):
    chunked, whole, builder, reference = engines
    prompt = build(builder, name)
    image_token = chunked.adapter.image_token_id
    assert len(prompt.token_ids) > 3 * BUDGET
    if PROMPTS[name][0]:
        assert image_cut_by_a_chunk(prompt.token_ids, image_token, BUDGET)
    expected = hf_greedy(reference, prompt, image_token, STEPS)
    request = chunked.add_request(f"chunked-{name}", prompt, greedy())
    steps = run_until_done(chunked)
    assert steps == -(-len(prompt.token_ids) // BUDGET) + STEPS - 1  # one step per chunk, then one per token
    reference_request = whole.add_request(f"whole-{name}", build(builder, name), greedy())
    assert run_until_done(whole) == STEPS
    assert reference_request.output_ids == expected  # the unchunked engine, as test_engine_parity asserts
    assert_same_tokens(reference, prompt, image_token, expected, request.output_ids)
    assert chunked.allocator.num_used == 0 and whole.allocator.num_used == 0


def test_decodes_keep_going_while_a_long_prompt_is_chunked(engines):
    chunked, _, builder, reference = engines
    short = build(builder, "one_image")
    short_expected = hf_greedy(reference, short, chunked.adapter.image_token_id, 30)
    stream = chunked.add_request("stream", short, greedy(30))
    while not stream.prompt_done:
        chunked.step()
    long_prompt = build(builder, "three_images")
    long = chunked.add_request("long", long_prompt, greedy())
    produced_while_chunking = 0
    while not long.prompt_done:
        before = len(stream.output_ids)
        outputs = chunked.step()
        assert [o.request_id for o in outputs] == ["stream"] or long.prompt_done
        produced_while_chunking += len(stream.output_ids) - before
    # every chunk step also decoded the stream: budget 16 - 1 decode = 15 prompt tokens per step
    assert produced_while_chunking == -(-len(long_prompt.token_ids) // (BUDGET - 1))
    run_until_done(chunked)
    image_token = chunked.adapter.image_token_id
    assert_same_tokens(reference, short, image_token, short_expected, stream.output_ids)
    assert_same_tokens(reference, long_prompt, image_token, hf_greedy(reference, long_prompt, image_token, STEPS),
                       long.output_ids)
    assert chunked.allocator.num_used == 0


def test_abort_mid_chunking_frees_the_blocks(engines):
    chunked, _, builder, _ = engines
    prompt = build(builder, "three_images")
    request = chunked.add_request("aborted", prompt, greedy())
    assert chunked.step() == []  # the first chunk: no token yet
    assert 0 < request.num_computed < len(prompt.token_ids) and chunked.allocator.num_used > 0
    (output,) = chunked.abort("aborted")
    assert output.finish_reason.value == "abort" and output.token_ids == []
    assert chunked.allocator.num_used == 0 and not chunked.has_work()


def test_hand_off_request_hands_its_blocks_over_only_after_the_last_chunk(engines):
    chunked, _, builder, reference = engines
    prompt = build(builder, "three_images")
    first_token = hf_greedy(reference, prompt, chunked.adapter.image_token_id, 1)
    request = chunked.add_request("prefill-side", prompt, greedy(), hand_off=True)
    chunks = -(-len(prompt.token_ids) // BUDGET)
    for _ in range(chunks - 1):
        assert chunked.step() == []
    (output,) = chunked.step()
    assert_same_tokens(reference, prompt, chunked.adapter.image_token_id, first_token, output.token_ids)
    assert output.finished and output.blocks == request.blocks
    assert request.num_computed == len(prompt.token_ids) and not chunked.has_work()
    assert chunked.allocator.num_used == len(output.blocks)  # held for the KV transfer until freed
    chunked.free_blocks(output.blocks)
    assert chunked.allocator.num_used == 0


@pytest.mark.unit
def test_slice_embeddings_takes_the_rows_of_each_image_a_chunk_covers():
    first = ImageEmbedding(torch.arange(12.0).reshape(4, 3), (1, 4, 4), torch.arange(24.0).reshape(2, 4, 3))
    second = ImageEmbedding(torch.arange(6.0).reshape(2, 3) + 100, (1, 2, 4), torch.zeros(2, 2, 3))
    pieces = slice_embeddings([first, second], 3, 5)  # the last row of the first image, the first of the second
    assert [p.embeds.tolist() for p in pieces] == [[[9.0, 10.0, 11.0]], [[100.0, 101.0, 102.0]]]
    assert pieces[0].deepstack is not None and pieces[0].deepstack.tolist() == [[[9.0, 10.0, 11.0]], [[21.0, 22.0, 23.0]]]
    assert [p.grid_thw for p in pieces] == [(1, 4, 4), (1, 2, 4)]
    whole = slice_embeddings([first, second], 0, 6)
    assert whole[0] is first and whole[1] is second  # an unchunked prompt splices its embeddings as they are
    assert slice_embeddings([first, second], 4, 4) == []
