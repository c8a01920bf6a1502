"""Prefix caching in the engine: greedy tokens with it on equal those with it off, token for token,
over multi-turn chats with images; hits are exactly the cached chain's blocks; images whose
placeholders lie in the hit are not encoded; two images of one size never share a block; a small
pool evicts cached blocks; an aborted request's completed blocks are hit afterwards; blocks in use
come back to 0.

On ``EPD_TEST_DEVICE`` (tests/support/devices.py); the CPU compares exactly, a GPU up to a near tie (a
continued prompt's attention is a different kernel shape from the whole prompt's)."""

from __future__ import annotations

import dataclasses

import pytest

from stages.engine.config import EngineConfig
from stages.engine.engine import Engine
from stages.engine.multimodal import Prompt
from stages.engine.prefix_cache import block_hashes, image_spans
from stages.engine.request import Request
from stages.engine.sampling_params import SamplingParams
from stages.engine.prefilled import FirstTokens, Prefilled
from stages.loading import load_engine
from tests.support.devices import DEVICE, on_gpu
from tests.support.generated_models import model_dir
from tests.support.hf_reference import random_image

STEPS = 6
BLOCK = 16
KEYS = {seed: f"{seed:064x}" for seed in range(1, 4)}  # content keys of the test images, by seed


def greedy(max_tokens: int = STEPS) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen3_vl", "llava"])
def engines(request):
    path = str(model_dir(request.param))
    config = EngineConfig(model=path, kv_cache_mib=1, device=DEVICE, block_size=BLOCK)  # 128 blocks of 8 KiB
    on, builder = load_engine(config, pixels=True)
    off, _ = load_engine(dataclasses.replace(config, prefix_caching=False), pixels=True)
    assert on.allocator.num_blocks == 128 and on.config.prefix_caching and not off.config.prefix_caching
    return on, off, builder


def run(engine: Engine, request_id: str, prompt: Prompt, params: SamplingParams | None = None) -> Request:
    request = engine.add_request(request_id, prompt, params or greedy())
    for _ in range(200):
        if not engine.has_work():
            return request
        engine.step()
    raise AssertionError("the engine did not finish within the bound")


def build(builder, turns: list[list], seeds: list[int]) -> Prompt:
    """A chat of ``turns`` (message lists alternating user / assistant), images by seed (64x64)."""
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": turn} for i, turn in enumerate(turns)]
    prompt = builder.build(messages, [random_image(64, 64, seed) for seed in seeds])
    prompt.image_keys = [KEYS[seed] for seed in seeds]
    return prompt


def expected_hit(engine: Engine, prompt: Prompt, cached: set[bytes]) -> int:
    """Tokens of the leading blocks whose chain hashes were registered, within ``len - 1`` tokens."""
    hashes = block_hashes(prompt.token_ids, BLOCK, engine.adapter.media_token_ids, prompt.image_tokens,
                          prompt.image_keys)
    hit = 0
    while hit < min(len(hashes), (len(prompt.token_ids) - 1) // BLOCK) and hashes[hit] in cached:
        hit += 1
    return hit * BLOCK


def registered(engine: Engine, prompt: Prompt) -> set[bytes]:
    """The chain hashes a finished prompt leaves in the cache: every full prompt block's."""
    return set(block_hashes(prompt.token_ids, BLOCK, engine.adapter.media_token_ids, prompt.image_tokens,
                            prompt.image_keys))


def cached_before(engine: Engine, prompt: Prompt) -> set[bytes]:
    """The prompt's leading chain hashes the engine holds now (other tests of the module share it)."""
    hashes = block_hashes(prompt.token_ids, BLOCK, engine.adapter.media_token_ids, prompt.image_tokens,
                          prompt.image_keys)
    return set(hashes[:len(engine.allocator.cached_prefix(hashes))])


class Counting:
    """Wraps an adapter's ``encode``: counts the images it is given."""

    def __init__(self, encode) -> None:
        self.encode, self.images = encode, 0

    def __call__(self, images):
        self.images += len(images)
        return self.encode(images)


def image(text: str) -> list[dict]:
    return [{"type": "image"}, {"type": "text", "text": text}]


def test_multi_turn_chat_with_the_same_image_in_turns_1_and_3(engines, monkeypatch):
    on, off, builder = engines
    if on_gpu():
        pytest.skip("exact parity on the CPU only; the GPU case is covered by the near-tie tests")
    turns: list = [image("describe this picture in detail please")]
    seeds, cached = [1], set[bytes]()
    for turn in range(3):
        prompt_on, prompt_off = build(builder, turns, seeds), build(builder, turns, seeds)
        counter = Counting(on.adapter.encode)
        monkeypatch.setattr(on.adapter, "encode", counter)
        want_hit = expected_hit(on, prompt_on, cached | cached_before(on, prompt_on))
        got, reference = run(on, f"on-{turn}", prompt_on), run(off, f"off-{turn}", prompt_off)
        monkeypatch.undo()
        assert got.output_ids == reference.output_ids and len(got.output_ids) == STEPS
        assert got.num_cached_tokens == want_hit and reference.num_cached_tokens == 0
        spans = image_spans(prompt_on.token_ids, on.adapter.media_token_ids, prompt_on.image_tokens)
        assert counter.images == sum(1 for _, end in spans if end > want_hit)  # the hit's images: not encoded
        if turn:
            assert want_hit > spans[0][1]  # turns 2 and 3 hit past the first image
        if turn == 2:
            assert counter.images == 1 and len(spans) == 2
        cached |= registered(on, prompt_on)
        answer = builder.tokenizer.decode(reference.output_ids, skip_special_tokens=True)
        turns += [answer, image("is it the same picture?") if turn == 1 else "what colors do you see?"]
        seeds += [1] if turn == 1 else []
    assert (on.allocator.num_used, off.allocator.num_used, off.allocator.num_cached) == (0, 0, 0)
    assert on.allocator.num_cached > 0


def test_two_images_of_one_size_in_equal_prompts_do_not_share_blocks(engines):
    on, off, builder = engines
    first = build(builder, [image("what is in this picture? " * 4)], [2])
    run(on, "first", first)
    second_on, second_off = (build(builder, [image("what is in this picture? " * 4)], [3]) for _ in range(2))
    assert second_on.token_ids == first.token_ids  # one size: the same placeholders, only the pixels differ
    got, reference = run(on, "second", second_on), run(off, "second", second_off)
    image_start = image_spans(first.token_ids, on.adapter.media_token_ids, first.image_tokens)[0][0]
    assert got.num_cached_tokens == image_start // BLOCK * BLOCK  # up to the block the image starts in
    if not on_gpu():
        assert got.output_ids == reference.output_ids
    assert on.allocator.num_used == 0


def test_a_small_pool_evicts_cached_blocks_and_still_answers_the_same(engines):
    on, off, builder = engines
    prompt = build(builder, [image("tell me a story about it " * 3)], [1])
    run(on, "warm", prompt)
    assert on.allocator.num_cached >= len(prompt.token_ids) // BLOCK
    filler = Prompt(token_ids=[prompt.token_ids[0]] * (on.max_model_len - 2))  # text only: 128 blocks
    hog = on.add_request("hog", filler, greedy(2))  # its prompt's blocks are the whole pool: evicts all
    on.step()
    assert on.allocator.num_used == on.allocator.num_blocks and on.allocator.num_cached == 0
    assert on.abort("hog") != []
    assert hog.num_cached_tokens == 0 and on.allocator.num_used == 0
    again = run(on, "again", build(builder, [image("tell me a story about it " * 3)], [1]))
    assert again.num_cached_tokens == 0  # every block of the first run was evicted
    if not on_gpu():
        assert again.output_ids == run(off, "again", build(builder, [image("tell me a story about it " * 3)], [1])).output_ids
    assert on.allocator.num_used == 0


def test_an_aborted_requests_completed_blocks_are_hit(engines):
    on, off, builder = engines
    on.scheduler.max_batched_tokens = 2 * BLOCK  # chunk this engine's prompts for this test
    try:
        turns = [[{"type": "text", "text": "why is the sky blue? explain slowly " * 3}, {"type": "image"}]]
        prompt = build(builder, turns, [1])
        request = on.add_request("aborted", prompt, greedy())
        assert on.step() == [] and request.num_computed == request.num_cached_tokens + 2 * BLOCK
        assert len(prompt.token_ids) > request.num_computed + BLOCK
        on.abort("aborted")
        assert on.allocator.num_used == 0
        retry = run(on, "retry", build(builder, turns, [1]))
    finally:
        on.scheduler.max_batched_tokens = on.config.batched_tokens
    assert retry.num_cached_tokens == request.num_computed  # every block the aborted chunk completed
    if not on_gpu():
        assert retry.output_ids == run(off, "retry", build(builder, turns, [1])).output_ids
    assert on.allocator.num_used == 0


def test_a_decode_reuses_its_own_cached_blocks_and_gets_only_the_rest():
    """A prefill engine and a decode engine, the KV copied block by block as the transfer does: the
    decode's second turn starts from its own cached blocks, only the blocks after them are copied,
    and it decodes the tokens an engine without prefix caching computes."""
    config = EngineConfig(model=str(model_dir("qwen3_vl")), kv_cache_mib=1, device=DEVICE, block_size=BLOCK)
    (prefill, builder), (decode, _) = load_engine(config, pixels=True), load_engine(config, pixels=True)
    reference, _ = load_engine(dataclasses.replace(config, prefix_caching=False), pixels=True)
    turns: list = [image("what is shown here, in detail?")]
    previous: list[int] = []
    for turn in range(2):
        prompt = build(builder, turns, [1])
        blocks, cached = decode.reserve_cached(prompt, greedy())
        assert cached * BLOCK == hit_after(previous, prompt.token_ids)  # turn 2: turn 1's shared full blocks
        handed = prefill.add_request(f"p-{turn}", prompt, greedy(), hand_off=True)
        while prefill.has_work():
            prefill.step()
        assert handed.num_cached_tokens == cached * BLOCK  # the prefill's own cache holds the same blocks
        copied = handed.blocks[cached:]  # what the transfer writes: the blocks after the decode's cached ones
        decode.pool.tensor[blocks[cached:len(handed.blocks)]] = prefill.pool.tensor[copied]
        prefill.free_blocks(handed.blocks)
        first_tokens = FirstTokens(handed.output_ids[:1])
        prefilled = Prefilled(f"d-{turn}", prompt, greedy(), blocks, first_tokens, handed.rope_delta,
                              cached_tokens=handed.num_cached_tokens)
        (first,) = decode.add_prefilled(prefilled)
        (request,) = decode.scheduler.running
        while decode.has_work():
            decode.step()
        expected = run(reference, f"r-{turn}", build(builder, turns, [1]))
        assert first.cached_tokens == handed.num_cached_tokens
        if not on_gpu():
            assert request.output_ids == expected.output_ids
        previous = prompt.token_ids
        turns += [builder.tokenizer.decode(expected.output_ids, skip_special_tokens=True), "and then?"]
    assert cached > 0 and (prefill.allocator.num_used, decode.allocator.num_used) == (0, 0)
    assert decode.allocator.num_cached >= len(previous) // BLOCK


def hit_after(earlier: list[int], later: list[int]) -> int:
    """Tokens of ``later`` found cached after ``earlier`` ran alone (text-equal prefix, same images)."""
    same = next((i for i, (a, b) in enumerate(zip(earlier, later)) if a != b), min(len(earlier), len(later)))
    return min(same // BLOCK, len(earlier) // BLOCK, (len(later) - 1) // BLOCK) * BLOCK
