"""The engine's side of guided decoding, with a fake guide that allows one token per step (a forced
sequence, then only end-of-sequence): the mask constrains greedy and sampled rows, every appended
token is accepted (a decode's first token, from its prefill, too), the matcher's state survives a
preemption, a matcher that raises fails its request alone, and logprobs stay raw (before the mask).
And a logit_bias naming no token of the vocabulary is refused on admission.
On ``EPD_TEST_DEVICE`` (tests/support/devices.py)."""

from __future__ import annotations

import random

import pytest
import torch

from stages.engine.config import EngineConfig
from stages.engine.engine import Engine
from stages.engine.outputs import RequestOutput
from stages.engine.sampling_params import SamplingParams
from stages.engine.prefilled import FirstTokens, Prefilled
from stages.loading import load_engine
from tests.support.devices import DEVICE
from tests.support.generated_models import model_dir


class ForcedMatcher:
    """Allows ``sequence[i]`` at step i, then only the end-of-sequence ids."""

    def __init__(self, sequence: list[int], eos: list[int], fail_at: int | None) -> None:
        self.sequence, self.eos, self.fail_at = sequence, eos, fail_at
        self.accepted: list[int] = []

    def allowed(self) -> list[int]:
        step = len(self.accepted)
        return [self.sequence[step]] if step < len(self.sequence) else self.eos

    def mask(self, logits: torch.Tensor) -> None:
        keep = torch.zeros_like(logits, dtype=torch.bool)
        keep[self.allowed()] = True
        logits.masked_fill_(~keep, float("-inf"))

    def accept(self, token_id: int) -> None:
        if token_id not in self.allowed() or len(self.accepted) == self.fail_at:
            raise ValueError(f"token {token_id} is not allowed here")
        self.accepted.append(token_id)

    @property
    def done(self) -> bool:
        return len(self.accepted) > len(self.sequence)


class ForcedGuide:
    def __init__(self, sequence: list[int], eos: list[int], fail_at: int | None = None) -> None:
        self.sequence, self.eos, self.fail_at = sequence, eos, fail_at
        self.matchers: list[ForcedMatcher] = []

    def matcher(self) -> ForcedMatcher:
        self.matchers.append(ForcedMatcher(self.sequence, self.eos, self.fail_at))
        return self.matchers[-1]


def forced(engine: Engine, length: int, seed: int) -> list[int]:
    eos = set(engine.decoding.eos_token_ids)
    rng = random.Random(seed)
    return [t for t in (rng.randrange(engine.vocab_size) for _ in range(3 * length)) if t not in eos][:length]


def guide_for(engine: Engine, length: int, seed: int, fail_at: int | None = None) -> ForcedGuide:
    return ForcedGuide(forced(engine, length, seed), sorted(engine.decoding.eos_token_ids), fail_at)


def prompt(builder, words: int = 3):
    return builder.build([{"role": "user", "content": [{"type": "text", "text": "say something " * words}]}], [])


def drain(engine: Engine, limit: int = 10_000) -> list[RequestOutput]:
    outputs = []
    for _ in range(limit):
        if not engine.has_work():
            return outputs
        outputs += engine.step()
    raise AssertionError("the engine did not finish")


@pytest.fixture(scope="module")
def loaded():
    config = EngineConfig(model=str(model_dir("qwen2_vl")), kv_cache_mib=16, device=DEVICE)
    return load_engine(config, pixels=True), config


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_the_mask_forces_the_sequence_and_every_token_is_accepted(loaded, temperature):
    (engine, builder), _ = loaded
    guide = guide_for(engine, 8, seed=1)
    params = SamplingParams(max_tokens=20, temperature=temperature, seed=5, guide=guide, logprobs=1)
    request = engine.add_request(f"forced-{temperature}", prompt(builder), params)
    outputs = drain(engine)
    (matcher,) = guide.matchers
    assert request.output_ids[:-1] == guide.sequence and request.output_ids[-1] in guide.eos
    assert matcher.accepted == request.output_ids and outputs[-1].finish_reason.value == "stop"
    # logprobs are the model's raw ones: a random forced token is not certain before the mask
    assert all(o.logprobs and o.logprobs[0].logprob < -1e-3 for o in outputs[:-1])


def test_a_matcher_that_raises_fails_its_request_alone(loaded):
    (engine, builder), _ = loaded
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    alone = engine.add_request("alone", prompt(builder, 2), greedy)
    drain(engine)
    bad = guide_for(engine, 8, seed=2, fail_at=3)
    other = engine.add_request("other", prompt(builder, 2), greedy)
    failing = engine.add_request("failing", prompt(builder), SamplingParams(max_tokens=8, temperature=0.0, guide=bad))
    outputs = drain(engine)
    errors = [o for o in outputs if o.error]
    assert [o.request_id for o in errors] == ["failing"] and "not allowed" in (errors[0].error or "")
    assert failing.output_ids == bad.sequence[:3] and other.output_ids == alone.output_ids
    assert engine.allocator.num_used == 0


def test_the_matcher_survives_a_preemption():
    config = EngineConfig(model=str(model_dir("qwen3_vl")), kv_cache_mib=1, device=DEVICE)
    engine, builder = load_engine(config, pixels=True)
    max_tokens = 700  # three requests at their longest need more blocks than the 1 MiB pool has
    assert 3 * (len(prompt(builder).token_ids) + max_tokens) > engine.allocator.num_blocks * engine.allocator.block_size
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    others = [engine.add_request(f"other-{i}", prompt(builder, 1 + i), greedy) for i in range(2)]
    guide = guide_for(engine, max_tokens - 1, seed=3)
    guided = engine.add_request("guided", prompt(builder), SamplingParams(
        max_tokens=max_tokens, temperature=1.0, seed=9, guide=guide, repetition_penalty=1.2))
    outputs = drain(engine)
    assert not [o.error for o in outputs if o.error]
    assert guided.num_preemptions > 0 and all(len(r.output_ids) == max_tokens for r in others)
    (matcher,) = guide.matchers  # one matcher, kept through the preemption
    assert guided.output_ids[:-1] == guide.sequence and guided.output_ids[-1] in guide.eos
    assert matcher.accepted == guided.output_ids


def test_a_decode_advances_its_own_matcher_with_the_prefills_first_token(loaded):
    (prefill, builder), config = loaded
    decode, _ = load_engine(config, pixels=True)
    guide = guide_for(prefill, 6, seed=4)
    params = SamplingParams(max_tokens=12, temperature=0.0, guide=guide, logprobs=2)
    room = prompt(builder)
    blocks = decode.reserve_blocks(room, params)
    handed = prefill.add_request("room", room, params, hand_off=True)
    (first,) = drain(prefill)
    assert first.token_ids == guide.sequence[:1] and first.logprobs is not None
    decode.pool.tensor[blocks[: len(handed.blocks)]] = prefill.pool.tensor[handed.blocks]
    prefill.free_blocks(handed.blocks)
    outputs = decode.add_prefilled(Prefilled("room", room, params, blocks, FirstTokens(first.token_ids, first.logprobs),
                                             handed.rope_delta))
    assert outputs[0].logprobs == first.logprobs
    outputs += drain(decode)
    tokens = [t for o in outputs for t in o.token_ids]
    assert tokens[:-1] == guide.sequence and tokens[-1] in guide.eos
    prefill_matcher, decode_matcher = guide.matchers
    assert prefill_matcher.accepted == guide.sequence[:1] and decode_matcher.accepted == tokens
    assert decode.allocator.num_used == 0


def test_a_logit_bias_outside_the_vocabulary_is_refused_on_admission(loaded):
    (engine, builder), _ = loaded
    with pytest.raises(ValueError, match=f"logit_bias names token {engine.vocab_size}"):
        engine.add_request("outside", prompt(builder), SamplingParams(logit_bias=((engine.vocab_size, 1.0),)))
    assert not engine.has_work() and "outside" not in engine._tracked
