"""What a request's parameters do to its logits before temperature: vLLM's logits processing.

In order, per row (``SamplingParams``' docstring): ``logit_bias`` is added; ``repetition_penalty``
divides the positive (multiplies the negative) logits of every token in the prompt or the output
so far; ``frequency_penalty`` times each token's count in the output is subtracted, and
``presence_penalty`` once for each token present in the output; then the guide's matcher sets the
tokens its grammar forbids to -inf. Temperature, top-k and top-p come after (``sampler``); all of
it applies to greedy rows too.

``process_logits`` works in place on the step's logits and touches only the rows whose parameters
``processes_logits``: a step without any costs nothing. Bias and penalties of all those rows are
applied together (a few tensor operations whatever their number), on a copy written back only when
it succeeded; if that raises, each row is tried alone, so one row's failure is its own: it gets an
error message and its logits stay as the model made them. A matcher is called on its own row only.
Never reads the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stages.engine.guide import GuideMatcher
from stages.engine.sampling_params import SamplingParams


@dataclass
class RowInputs:
    """What one row's processing needs: the logits' row index, the request's parameters, its tokens
    (prompt, output so far) and its guide matcher, if any."""

    row: int
    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]
    matcher: GuideMatcher | None = None


def process_logits(logits: torch.Tensor, rows: list[RowInputs]) -> dict[int, str]:
    """Apply each row's bias, penalties and guide mask to ``logits`` [N, vocab] in place; rows not
    named are left alone. Returns the rows that failed, each with why (their logits unchanged)."""
    failed: dict[int, str] = {}
    penalized = [r for r in rows if _has_bias_or_penalty(r.params)]
    if penalized:
        try:
            _penalize(logits, penalized)
        except Exception:  # noqa: BLE001 - find the row(s) at fault: each alone
            for row in penalized:
                try:
                    _penalize(logits, [row])
                except Exception as exc:  # noqa: BLE001 - this row's failure only
                    failed[row.row] = f"logits processing failed: {type(exc).__name__}: {exc}"
    for row in rows:
        if row.matcher is not None and row.row not in failed:
            try:
                row.matcher.mask(logits[row.row])
            except Exception as exc:  # noqa: BLE001 - the guide's failure is this row's only
                failed[row.row] = f"guide mask failed: {type(exc).__name__}: {exc}"
    return failed


def _has_bias_or_penalty(params: SamplingParams) -> bool:
    return bool(params.logit_bias or params.presence_penalty or params.frequency_penalty
                or params.repetition_penalty != 1.0)


def _penalize(logits: torch.Tensor, rows: list[RowInputs]) -> None:
    """Bias and penalties of ``rows`` together, computed on a copy of their logits and written back
    at the end (a raise leaves ``logits`` untouched). Raises ValueError on a token id out of range."""
    vocab, device = logits.shape[-1], logits.device
    index = torch.tensor([r.row for r in rows], dtype=torch.long, device=device)
    sub = logits.index_select(0, index)  # a copy
    bias = [(i, token, value) for i, r in enumerate(rows) for token, value in r.params.logit_bias]
    if bias:
        _check_ids([token for _, token, _ in bias], vocab, "logit_bias")
        at, tokens, values = zip(*bias)
        sub.index_put_((_ids(at, device), _ids(tokens, device)),
                       torch.tensor(values, dtype=sub.dtype, device=device), accumulate=True)
    counted = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0
               or r.params.frequency_penalty or r.params.presence_penalty]
    if counted:
        counts = _counts(sub, [rows[i].output_ids for i in counted], vocab)  # [len(counted), vocab]
        part = sub[_ids(counted, device)]
        if any(rows[i].params.repetition_penalty != 1.0 for i in counted):
            repetition = _column([rows[i].params.repetition_penalty for i in counted], part).to(device)
            seen = (counts > 0) | (_counts(sub, [rows[i].prompt_ids for i in counted], vocab) > 0)
            factor = torch.where(seen, repetition, torch.ones_like(part))
            part = torch.where(part > 0, part / factor, part * factor)
        frequency = _column([rows[i].params.frequency_penalty for i in counted], part).to(device)
        presence = _column([rows[i].params.presence_penalty for i in counted], part).to(device)
        part = part - frequency * counts - presence * (counts > 0).to(part.dtype)
        sub[_ids(counted, device)] = part
    logits.index_copy_(0, index, sub)


def _counts(like: torch.Tensor, token_lists: list[list[int]], vocab: int) -> torch.Tensor:
    """[len(token_lists), vocab] counts of each token in each list, in ``like``'s dtype, on its device."""
    _check_ids([token for tokens in token_lists for token in tokens], vocab, "token")
    flat = _ids([row * vocab + token for row, tokens in enumerate(token_lists) for token in tokens], like.device)
    counts = like.new_zeros(len(token_lists) * vocab)  # scatter_add_, not bincount: that reads the device on a GPU
    return counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=like.dtype)).view(len(token_lists), vocab)


def _column(values: list[float], like: torch.Tensor) -> torch.Tensor:
    """[len(values), 1] on the host, in ``like``'s dtype (moved to the device where used)."""
    return torch.tensor(values, dtype=like.dtype).unsqueeze(1)


def _ids(values, device: torch.device) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.long, device=device)


def _check_ids(tokens: list[int], vocab: int, what: str) -> None:
    """Out-of-range ids would be a device-side assert on a GPU: refuse them on the host first."""
    bad = [t for t in tokens if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"{what} id {bad[0]} is not in this model's vocabulary of {vocab}")
