"""Picks the next token of each request from its logits. Pure torch, no state besides the generators.

Greedy rows take the argmax (ties go to the lowest id, as in ``generate()``). Sampled rows apply
temperature, then top-k, then top-p, and draw with the request's own generator, so a seeded
request gives the same tokens whatever else shares its batch.

One row's failure is its own: a row whose parameters cannot be sampled (a temperature so small that
the scaled logits overflow, say) gets a ``SamplingError`` in place of its token, and the other rows
are drawn as if it were not there.

Devices: logits and generators live on the engine's device, and ``sample`` reads the device once
per step (the token ids and each sampled row's verdict, together); the engine, which reads logprobs
in the same copy, calls its halves, ``draw_rows`` (device only) and ``results`` (after the read). A row that cannot be sampled is
drawn from a harmless distribution meanwhile and reported after that read: on a GPU,
``multinomial`` over NaN or infinite probabilities is a device-side assert, not an exception.
The draw is ``torch.multinomial``'s own algorithm for one sample (argmax of p / q, q ~ Exp(1)),
written out because ``multinomial`` reads the device twice to check its input: same random
numbers, same token (``Engine._skip_draw`` relies on the count of random numbers being the same).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stages.engine.sampling_params import SamplingParams

SAMPLEABLE, NOT_FINITE, OVERFLOW = 0, 1, 2  # a sampled row's verdict, read on the host with its token


class SamplingError(ValueError):
    """One request's logits could not be sampled with its parameters; the message names them."""


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A request's own generator on ``device`` (the engine's), seeded with ``seed`` or at random."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)  # SamplingParams has checked that torch takes it
    return generator


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """One row of logits scaled by temperature with everything outside top-k / top-p set to -inf.
    Never reads the device; rows it cannot make sense of are caught by ``sample`` (``_verdict``)."""
    logits = logits / params.temperature
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


@dataclass
class Drawn:
    """One step's draw, still on the device: a token and a verdict per row, and the rows that failed
    while drawing (before any read)."""

    tokens: torch.Tensor  # [N] int64
    verdicts: torch.Tensor  # [N] int64, SAMPLEABLE for greedy rows
    failed: dict[int, SamplingError]


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator]) -> list[int | SamplingError]:
    """logits [N, vocab] float32 -> one token id per row, or the row's SamplingError."""
    drawn = draw_rows(logits, params, generators)
    ids, verdicts = torch.stack([drawn.tokens, drawn.verdicts]).tolist()  # the step's one read of the device
    return results(drawn, ids, verdicts, params, logits.dtype)


def draw_rows(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]) -> Drawn:
    """``sample`` up to its read of the device: whoever reads ``tokens`` and ``verdicts`` (with whatever
    else the step reads) hands the values to ``results``."""
    tokens = logits.argmax(dim=-1)
    verdicts = torch.zeros_like(tokens)
    failed: dict[int, SamplingError] = {}
    for row, (p, generator) in enumerate(zip(params, generators)):
        if p.greedy:
            continue
        try:
            tokens[row], verdicts[row] = _draw(logits[row], p, generator)
        except Exception as exc:  # noqa: BLE001 - whatever torch raises for this row stays with this row
            failed[row] = SamplingError(f"sampling failed with temperature={p.temperature!r}, top_p={p.top_p!r}, "
                                        f"top_k={p.top_k}: {type(exc).__name__}: {exc}")
    return Drawn(tokens, verdicts, failed)


def results(drawn: Drawn, ids: list[int], verdicts: list[int], params: list[SamplingParams],
            dtype: torch.dtype) -> list[int | SamplingError]:
    """Each row's token, or its SamplingError, from the values read of ``drawn``."""
    return [drawn.failed.get(row) or _result(ids[row], verdicts[row], p, dtype) for row, p in enumerate(params)]


def _draw(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(token, verdict) of one sampled row, both still on the device."""
    verdict = _verdict(logits, params)
    probs = filter_logits(logits, params).softmax(-1)
    probs = torch.where(verdict == SAMPLEABLE, probs, torch.ones_like(probs))  # see the module docstring
    return draw(probs, generator), verdict


def draw(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """``torch.multinomial(probs, 1, generator=generator)[0]`` for one row of valid probabilities,
    without its host reads: the same exponential draw over ``probs.numel()`` numbers, the same token."""
    q = torch.empty_like(probs).exponential_(1, generator=generator)
    return (probs / q).argmax(-1)


def _verdict(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    finite, scaled = torch.isfinite(logits.max()), torch.isfinite((logits / params.temperature).max())
    return torch.where(finite, torch.where(scaled, SAMPLEABLE, OVERFLOW), NOT_FINITE)


def _result(token: int, verdict: int, params: SamplingParams, dtype: torch.dtype) -> int | SamplingError:
    if verdict == NOT_FINITE:
        return SamplingError("the model's logits for this request are not finite")
    if verdict == OVERFLOW:
        return SamplingError(f"temperature={params.temperature!r} scales the logits out of {dtype} range; "
                             "use temperature 0 for greedy decoding")
    return token
