"""Picks the next token of each request from its logits. Pure torch, no state besides the generators.

Greedy rows take the argmax (ties go to the lowest id, as in ``generate()``). Sampled rows apply
temperature, then top-k, then top-p, and draw with the request's own generator, so a seeded
request gives the same tokens whatever else shares its batch.
"""

from __future__ import annotations

import torch

from stages.engine.sampling_params import SamplingParams


def make_generator(seed: int | None) -> torch.Generator:
    generator = torch.Generator()
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """One row of logits scaled by temperature with everything outside top-k / top-p set to -inf."""
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # keep the smallest prefix whose mass reaches top_p (always at least the top token)
        drop = probs.cumsum(-1) - probs >= params.top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]) -> list[int]:
    """logits [N, vocab] float32 -> one token id per row."""
    tokens = logits.argmax(dim=-1).tolist()
    for row, (p, generator) in enumerate(zip(params, generators)):
        if not p.greedy:
            probs = filter_logits(logits[row], p).softmax(-1)
            tokens[row] = int(torch.multinomial(probs, 1, generator=generator).item())
    return tokens
