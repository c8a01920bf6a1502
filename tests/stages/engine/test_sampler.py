"""Sampling rules on hand-made logits: greedy, temperature, top-k, top-p, seeds."""

import pytest
import torch

from stages.engine.sampler import filter_logits, make_generator, sample
from stages.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.unit

LOGITS = torch.tensor([1.0, 3.0, 2.0, 0.5, 2.9])


def draws(params: SamplingParams, n: int = 400, seed: int = 0) -> set[int]:
    generator = make_generator(seed)
    return {sample(LOGITS[None], [params], [generator])[0] for _ in range(n)}


def test_greedy_is_argmax_with_lowest_id_on_ties():
    logits = torch.tensor([[0.0, 5.0, 5.0], [9.0, 1.0, 9.0]])
    greedy = SamplingParams(temperature=0.0)
    assert sample(logits, [greedy, greedy], [make_generator(0)] * 2) == [1, 0]


def test_top_k_limits_the_support():
    assert draws(SamplingParams(temperature=1.0, top_k=2)) == {1, 4}
    assert draws(SamplingParams(temperature=1.0, top_k=1)) == {1}


def test_top_p_keeps_smallest_prefix_reaching_p():
    probs = LOGITS.softmax(-1)
    kept = filter_logits(LOGITS, SamplingParams(temperature=1.0, top_p=0.5))
    assert probs[1] < 0.5 <= probs[1] + probs[4]  # the check below is about a two-token prefix
    assert torch.isfinite(kept).tolist() == [False, True, False, False, True]
    assert draws(SamplingParams(temperature=1.0, top_p=1e-6)) == {1}


def test_high_temperature_reaches_every_token():
    assert draws(SamplingParams(temperature=2.0)) == {0, 1, 2, 3, 4}


def test_seed_makes_draws_reproducible_whatever_shares_the_batch():
    params = SamplingParams(temperature=1.0, seed=7)
    alone = [sample(LOGITS[None], [params], [g])[0] for g in [make_generator(7)] for _ in range(20)]
    g, other = make_generator(7), make_generator(123)
    batched = [sample(torch.stack([LOGITS, LOGITS]), [params, SamplingParams(temperature=1.0)], [g, other])[0]
               for _ in range(20)]
    assert alone == batched


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_tokens": 0}, "max_tokens must be at least 1"),
        ({"temperature": -0.1}, "temperature must be in"),
        ({"top_p": 0.0}, "top_p must be in"),
        ({"top_k": -1}, "top_k must be >= 0"),
        ({"stop": ("",)}, "stop strings must be non-empty"),
    ],
)
def test_invalid_params_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)
