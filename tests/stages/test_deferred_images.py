"""No pixels decoded or preprocessed for an image the prefix cache covers (PIXELS mode: colocated, PD
prefill): ``stages.api.chat.Preparer`` leaves it ``ImageInput.deferred`` (its bytes kept) when the
engine's prefix hint holds its placeholders, with the same token ids as its pixels would give; the
engine makes its pixels only if the hint went stale (its blocks evicted before admission), then
answers exactly as without prefix caching; a deferred image that cannot be made fails its request
alone. In-process over generated tiny models (the servers' counter: tests/e2e/test_prefix_cache.py)."""

from __future__ import annotations

import base64
import dataclasses
import io
import json

import pytest
import torch

from stages.api.chat import ImageMode, Preparer, hf_messages
from stages.api.parse import parse_request
from stages.config import ImageLimits
from stages.engine.config import EngineConfig
from stages.engine.engine import Engine
from stages.engine.image_encoding import load_deferred
from stages.engine.multimodal import ImageInput, Prompt
from stages.engine.prefix_cache import covered_items
from stages.engine.request import Request
from stages.engine.sampling_params import SamplingParams
from stages.loading import load_engine
from tests.support.devices import DEVICE, on_gpu
from tests.support.generated_models import model_dir
from tests.support.hf_reference import random_image

STEPS = 6
LIMITS = ImageLimits(max_images=3, max_pixels=512 * 512)
TURN_1 = "describe this picture in every detail you can"


# --- pure logic -------------------------------------------------------------------------------------
@pytest.mark.unit
def test_an_item_is_covered_only_when_its_whole_span_is_in_the_cached_prefix():
    tokens = [1, 9, 9, 9, 2, 3, 9, 9, 4]  # item 0 at [1, 4), item 1 at [6, 8)
    assert covered_items(tokens, {9}, [3, 2], 0) == frozenset()
    assert covered_items(tokens, {9}, [3, 2], 3) == frozenset()  # item 0 cut
    assert covered_items(tokens, {9}, [3, 2], 4) == {0}
    assert covered_items(tokens, {9}, [3, 2], 7) == {0}
    assert covered_items(tokens, {9}, [3, 2], 8) == {0, 1}


@pytest.mark.unit
def test_a_deferred_image_is_made_by_its_loader_and_checked_against_what_it_claimed():
    made = ImageInput(torch.ones(4, 6), (1, 2, 2), 1)
    calls: list[int] = []
    deferred = ImageInput.deferred(1, (1, 2, 2), lambda: calls.append(1) or made)
    assert deferred.is_deferred and deferred.pixel_values.numel() == 0 and calls == []
    assert deferred.loaded() is made and calls == [1]
    assert made.loaded() is made and not made.is_deferred
    with pytest.raises(ValueError, match="fill 1 placeholder tokens"):
        ImageInput.deferred(2, (1, 2, 2), lambda: made).loaded()


@pytest.mark.unit
def test_load_deferred_makes_only_the_wanted_deferred_images_and_names_a_failure():
    made = ImageInput(torch.ones(4, 6), None, 3)

    def broken() -> ImageInput:
        raise OSError("truncated")

    images = [ImageInput.deferred(3, None, lambda: made), ImageInput.deferred(3, None, lambda: made), made]
    assert load_deferred(images, [1, 2]) is None
    assert images[0].is_deferred and images[1] is made and images[2] is made
    images = [ImageInput.deferred(3, None, broken)]
    assert load_deferred(images, [0]) == "image 0 could not be decoded and preprocessed: OSError: truncated"
    assert images[0].is_deferred


# --- the Preparer and the engine over a tiny model ----------------------------------------------------
@pytest.fixture(scope="module", params=["qwen3_vl", "llava"])
def engines(request):
    path = str(model_dir(request.param))
    config = EngineConfig(model=path, kv_cache_mib=1, device=DEVICE, block_size=16)
    on, builder = load_engine(config, pixels=True)
    off, _ = load_engine(dataclasses.replace(config, prefix_caching=False), pixels=True)
    return on, off, builder


def png_url(seed: int) -> str:
    buffer = io.BytesIO()
    random_image(64, 64, seed).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def chat(seed: int, answer: str | None = None):
    """Turn 1 about image ``seed``, or turn 2 after ``answer``: the request as a server parses it."""
    messages: list[dict] = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": png_url(seed)}},
                                                        {"type": "text", "text": TURN_1}]}]
    if answer is not None:
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "and its colors?"}]
    return parse_request(json.dumps({"messages": messages, "max_tokens": STEPS, "temperature": 0}).encode())


def greedy() -> SamplingParams:
    return SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)


def run(engine: Engine, request_id: str, prompt: Prompt) -> Request:
    request = engine.add_request(request_id, prompt, greedy())
    for _ in range(200):
        if not engine.has_work():
            return request
        engine.step()
    raise AssertionError("the engine did not finish within the bound")


def eager(builder, request, keys: list[str] | None) -> Prompt:
    """The prompt as a PIXELS stage built it before deferral: every image decoded and preprocessed."""
    prompt = builder.build(hf_messages(request), [random_image(64, 64, 1)])
    prompt.image_keys = keys
    return prompt


def evict_all(engine: Engine) -> None:
    """A text prompt whose blocks are the whole pool: every cached block is evicted, then it is aborted."""
    engine.add_request("hog", Prompt(token_ids=[1] * (engine.max_model_len - 2)), SamplingParams(max_tokens=2))
    engine.step()
    assert engine.allocator.num_cached == 0
    engine.abort("hog")
    assert engine.allocator.num_used == 0


def second_turn(engines, skipped: list[int]):
    """Turn 1 run on the caching engine, then turn 2 prepared by its Preparer (counting into ``skipped``)."""
    on, off, builder = engines
    evict_all(on)  # each test starts from an empty cache
    preparer = Preparer(builder, on, LIMITS, ImageMode.PIXELS, observe_skipped=skipped.append)
    first, _ = preparer(chat(1))
    assert not first.images[0].is_deferred and skipped == []  # nothing cached yet: decoded as always
    answer = builder.tokenizer.decode(run(on, "turn-1", first).output_ids, skip_special_tokens=True)
    request = chat(1, answer)
    second, _ = preparer(request)
    return second, eager(builder, request, second.image_keys)


def test_a_covered_image_is_not_preprocessed_and_the_answer_is_exact(engines, monkeypatch):
    on, off, builder = engines
    skipped: list[int] = []
    second, reference = second_turn(engines, skipped)
    assert second.images[0].is_deferred and skipped == [1]
    assert second.token_ids == reference.token_ids and second.image_tokens == reference.image_tokens
    assert second.image_grids == reference.image_grids  # the same block hashes as the pixels' prompt
    monkeypatch.setattr(builder, "preprocess_item", lambda item: pytest.fail("a covered image was preprocessed"))
    got, want = run(on, "turn-2", second), run(off, "turn-2", reference)
    assert got.num_cached_tokens > 0 and second.images[0].is_deferred  # never made
    if not on_gpu():
        assert got.output_ids == want.output_ids


def test_a_stale_hint_makes_the_image_late_and_answers_exactly(engines):
    on, off, builder = engines
    skipped: list[int] = []
    second, reference = second_turn(engines, skipped)
    assert second.images[0].is_deferred and skipped == [1]
    evict_all(on)  # the blocks the hint saw are gone before admission
    got, want = run(on, "stale", second), run(off, "stale", reference)
    assert got.num_cached_tokens == 0 and len(got.output_ids) == STEPS  # answered, not failed
    assert not second.images[0].is_deferred  # made on the engine thread
    assert torch.equal(second.images[0].pixel_values, reference.images[0].pixel_values)
    if not on_gpu():
        assert got.output_ids == want.output_ids


def test_a_deferred_image_that_cannot_be_made_fails_its_request_alone(engines):
    on, off, builder = engines
    evict_all(on)
    preparer = Preparer(builder, on, LIMITS, ImageMode.PIXELS)
    good, bad = preparer(chat(1))[0], preparer(chat(2))[0]
    real = bad.images[0]

    def broken() -> ImageInput:
        raise OSError("the bytes are gone")

    bad.images[0] = ImageInput.deferred(real.num_tokens, real.grid_thw, broken)
    on.add_request("bad", bad, greedy())
    request = on.add_request("good", good, greedy())
    outputs = {}
    for _ in range(200):
        if not on.has_work():
            break
        outputs.update({o.request_id: o for o in on.step() if o.finished})
    error = outputs["bad"].error
    assert error is not None and "could not be decoded and preprocessed: OSError: the bytes are gone" in error
    assert outputs["good"].error is None and len(request.output_ids) == STEPS and on.allocator.num_used == 0
    if not on_gpu():
        assert request.output_ids == run(off, "good", eager(builder, chat(1), good.image_keys)).output_ids
