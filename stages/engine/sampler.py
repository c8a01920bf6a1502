"""Picks the next token of each request from its logits. Pure torch, no state besides the generators.

Greedy rows take the argmax (ties go to the lowest id, as in ``generate()``). Sampled rows apply
temperature, then top-k, then top-p, and draw with the request's own generator, so a seeded
request gives the same tokens whatever else shares its batch.

One row's failure is its own: a row whose parameters cannot be sampled (a temperature so small that
the scaled logits overflow, say) gets a ``SamplingError`` in place of its token, and the other rows
are drawn as if it were not there.
"""

from __future__ import annotations

import torch

from stages.engine.sampling_params import SamplingParams


class SamplingError(ValueError):
    """One request's logits could not be sampled with its parameters; the message names them."""


def make_generator(seed: int | None) -> torch.Generator:
    generator = torch.Generator()
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)  # SamplingParams has checked that torch takes it
    return generator


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """One row of logits scaled by temperature with everything outside top-k / top-p set to -inf.
    Raises SamplingError if the logits are not finite or the temperature scales them out of range."""
    if not torch.isfinite(logits.max()):
        raise SamplingError("the model's logits for this request are not finite")
    logits = logits / params.temperature
    if not torch.isfinite(logits.max()):
        raise SamplingError(f"temperature={params.temperature!r} scales the logits out of {logits.dtype} range; "
                            "use temperature 0 for greedy decoding")
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # keep the smallest prefix whose mass reaches top_p, and always the top token (a top_p
        # below the dtype's smallest number compares as 0 and would otherwise drop every token)
        drop = probs.cumsum(-1) - probs >= params.top_p
        drop[0] = False
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator]) -> list[int | SamplingError]:
    """logits [N, vocab] float32 -> one token id per row, or the row's SamplingError."""
    tokens: list[int | SamplingError] = list(logits.argmax(dim=-1).tolist())
    for row, (p, generator) in enumerate(zip(params, generators)):
        if not p.greedy:
            tokens[row] = _draw(logits[row], p, generator)
    return tokens


def _draw(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int | SamplingError:
    try:
        probs = filter_logits(logits, params).softmax(-1)
        return int(torch.multinomial(probs, 1, generator=generator).item())
    except SamplingError as exc:
        return exc
    except Exception as exc:  # noqa: BLE001 - whatever torch raises for this row stays with this row
        return SamplingError(f"sampling failed with temperature={params.temperature!r}, top_p={params.top_p!r}, "
                             f"top_k={params.top_k}: {type(exc).__name__}: {exc}")
