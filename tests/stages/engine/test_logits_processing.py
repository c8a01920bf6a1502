"""Logit bias and penalties against a hand computation on given logits (vLLM's semantics), and the
failure of one row staying with that row. Pure tensors, no model."""

from __future__ import annotations

import pytest
import torch

from stages.engine.logits_processing import RowInputs, process_logits
from stages.engine.sampler import make_generator, sample
from stages.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.unit

LOGITS = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0],
                       [1.0, 1.0, -0.5, 0.0, 2.0, -3.0]])
PROMPT = [0, 1]  # token 0 (positive logit) and 1 (negative) appear in the prompt
OUTPUT = [3, 3, 4]  # token 3 twice, token 4 once


def expected(row: list[float], bias=(), repetition=1.0, frequency=0.0, presence=0.0,
             prompt=PROMPT, output=OUTPUT) -> list[float]:
    """The hand computation, one token at a time, in vLLM's order."""
    out = []
    for token, value in enumerate(row):
        value += dict(bias).get(token, 0.0)
        if token in prompt or token in output:
            value = value / repetition if value > 0 else value * repetition
        count = output.count(token)
        value -= frequency * count + presence * (count > 0)
        out.append(value)
    return out


def processed(params: SamplingParams, row: int = 0) -> list[float]:
    logits = LOGITS.clone()
    assert process_logits(logits, [RowInputs(row, params, PROMPT, OUTPUT)]) == {}
    assert torch.equal(logits[1 - row], LOGITS[1 - row])  # the other row is left alone
    return logits[row].tolist()


CASES = {
    "bias": dict(bias=((3, -5.0), (5, 2.5))),
    "repetition": dict(repetition=1.5),
    "repetition_below_one": dict(repetition=0.5),
    "frequency": dict(frequency=0.75),
    "negative_frequency": dict(frequency=-1.0),
    "presence": dict(presence=1.25),
    "combined": dict(bias=((0, 1.0), (4, -0.5)), repetition=1.3, frequency=0.4, presence=0.6),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_penalty_alone_and_combined_match_the_hand_computation(case):
    kwargs = CASES[case]
    params = SamplingParams(logit_bias=kwargs.get("bias", ()), repetition_penalty=kwargs.get("repetition", 1.0),
                            frequency_penalty=kwargs.get("frequency", 0.0), presence_penalty=kwargs.get("presence", 0.0))
    for row in (0, 1):
        assert processed(params, row) == pytest.approx(expected(LOGITS[row].tolist(), **kwargs), abs=1e-6)


def test_rows_processed_together_equal_each_alone():
    a = SamplingParams(repetition_penalty=1.7, presence_penalty=0.5)
    b = SamplingParams(logit_bias=((2, 4.0),), frequency_penalty=1.5)
    together = LOGITS.clone()
    assert process_logits(together, [RowInputs(0, a, PROMPT, OUTPUT), RowInputs(1, b, [5], [2, 2])]) == {}
    assert together[0].tolist() == pytest.approx(expected(LOGITS[0].tolist(), repetition=1.7, presence=0.5))
    assert together[1].tolist() == pytest.approx(expected(LOGITS[1].tolist(), bias=((2, 4.0),), frequency=1.5,
                                                          prompt=[5], output=[2, 2]))


def test_greedy_and_sampled_rows_pick_from_the_processed_logits():
    # row 0's argmax is token 3 (3.0); a bias of -5 moves it to token 0; row 1 (sampled, top_k=1) likewise
    greedy = SamplingParams(temperature=0.0, logit_bias=((3, -5.0),))
    sampled = SamplingParams(temperature=1.0, top_k=1, presence_penalty=2.0)  # token 4 (2.0) was in the output
    logits = LOGITS.clone()
    assert process_logits(logits, [RowInputs(0, greedy, PROMPT, OUTPUT), RowInputs(1, sampled, PROMPT, OUTPUT)]) == {}
    assert sample(logits, [greedy, sampled], [make_generator(0), make_generator(1)]) == [0, 0]


def test_a_bad_row_fails_alone_with_its_logits_unchanged():
    good = SamplingParams(frequency_penalty=1.0)
    bad = SamplingParams(logit_bias=((99, 1.0),))  # no such token: the engine refuses it on admission
    logits = LOGITS.clone()
    failed = process_logits(logits, [RowInputs(0, bad, PROMPT, OUTPUT), RowInputs(1, good, PROMPT, OUTPUT)])
    assert set(failed) == {0} and "99" in failed[0]
    assert torch.equal(logits[0], LOGITS[0])
    assert logits[1].tolist() == pytest.approx(expected(LOGITS[1].tolist(), frequency=1.0))


class Matcher:
    def __init__(self, allowed: list[int] | None) -> None:
        self.allowed = allowed

    def mask(self, logits: torch.Tensor) -> None:
        if self.allowed is None:
            raise RuntimeError("broken grammar")
        keep = torch.zeros_like(logits, dtype=torch.bool)
        keep[self.allowed] = True
        logits.masked_fill_(~keep, float("-inf"))

    def accept(self, token_id: int) -> None:
        pass

    @property
    def done(self) -> bool:
        return False


def test_the_guide_mask_comes_after_the_penalties_and_a_failing_mask_fails_its_row_alone():
    params = SamplingParams(temperature=0.0, presence_penalty=2.0)
    logits = LOGITS.clone()
    failed = process_logits(logits, [RowInputs(0, params, PROMPT, OUTPUT, Matcher([3, 5])),
                                     RowInputs(1, params, PROMPT, OUTPUT, Matcher(None))])
    assert set(failed) == {1} and "broken grammar" in failed[1]
    row = expected(LOGITS[0].tolist(), presence=2.0)
    assert logits[0].tolist() == [v if t in (3, 5) else float("-inf") for t, v in enumerate(row)]
    assert sample(logits[:1], [params], [make_generator(0)]) == [3]  # 3.0 - 2.0 = 1.0 ties token 5: lowest id
