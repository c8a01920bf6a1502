"""What a request's parameters do to its logits before temperature: vLLM's logits processing.

In order, per row (``SamplingParams``' docstring): ``logit_bias`` is added; ``repetition_penalty``
divides the positive (multiplies the negative) logits of every token in the prompt or the output
so far; ``frequency_penalty`` times each token's count in the output is subtracted, and
``presence_penalty`` once for each token present in the output; then the guide's matcher sets the
tokens its grammar forbids to -inf. Temperature, top-k and top-p come after (``sampler``); all of
it applies to greedy rows too.

``process_logits`` works in place on the step's logits and touches only the rows whose parameters
``processes_logits``: a step without any costs nothing. Bias and penalties of all those rows are
applied together, to the (row, token) pairs they change only (a few tensor operations over those
pairs, not over rows x vocabulary), written in one go at the end; if that raises, each row is
tried alone, so one row's failure is its own: it gets an error message and its logits stay as the
model made them. A matcher is called on its own row only. Never reads the device.
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
    """Bias and penalties of ``rows`` together. Sparse: only the (row, token) pairs they change (the
    bias's tokens, the output's, the prompt's with a repetition penalty) are gathered, computed in
    vLLM's order and written back in one ``index_put_`` at the end, so a raise leaves ``logits``
    untouched. The pairs are worked out on the host with tensor operations (no loop over tokens),
    then copied to the device at once. Raises ValueError on a token id out of range."""
    vocab = logits.shape[-1]
    parts = [_pairs(row, vocab) for row in rows]
    at = torch.cat([torch.full_like(tokens, row.row) for row, (tokens, _) in zip(rows, parts)])
    tokens = torch.cat([tokens for tokens, _ in parts])
    if not len(tokens):
        return
    index = torch.stack([at, tokens]).to(logits.device)
    added, repetition, count, frequency, presence = torch.cat([columns for _, columns in parts], dim=1).to(
        device=logits.device, dtype=logits.dtype)
    values = logits[index[0], index[1]] + added
    values = torch.where(values > 0, values / repetition, values * repetition)
    values = values - frequency * count - presence * (count > 0).to(values.dtype)
    logits.index_put_((index[0], index[1]), values)


def _pairs(row: RowInputs, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One row's changed tokens (sorted, distinct; host int64) and per token, as float64 [5, tokens]:
    its bias, its repetition penalty (1 where it does not apply), its count in the output, the row's
    frequency and presence penalties. On the CPU whatever torch's default device."""
    p = row.params
    counted = p.frequency_penalty or p.presence_penalty or p.repetition_penalty != 1.0
    output = torch.tensor(row.output_ids if counted else [], dtype=torch.long, device="cpu")
    prompt = torch.tensor(row.prompt_ids if p.repetition_penalty != 1.0 else [], dtype=torch.long, device="cpu")
    biased = torch.tensor([token for token, _ in p.logit_bias], dtype=torch.long, device="cpu")
    for what, ids in (("logit_bias", biased), ("token", output), ("token", prompt)):
        _check_ids(ids, vocab, what)
    tokens = torch.cat([prompt, output, biased]).unique()  # sorted
    columns = torch.zeros(5, len(tokens), dtype=torch.float64, device="cpu")
    columns[0, torch.searchsorted(tokens, biased)] = torch.tensor([bias for _, bias in p.logit_bias],
                                                                   dtype=torch.float64, device="cpu")
    columns[1] = 1.0
    if p.repetition_penalty != 1.0:
        columns[1, torch.searchsorted(tokens, torch.cat([prompt, output]))] = p.repetition_penalty
    columns[2].index_add_(0, torch.searchsorted(tokens, output), torch.ones_like(output, dtype=torch.float64))
    columns[3], columns[4] = p.frequency_penalty, p.presence_penalty
    return tokens, columns


def _check_ids(tokens: torch.Tensor, vocab: int, what: str) -> None:
    """Out-of-range ids would be a device-side assert on a GPU: refuse them on the host first."""
    bad = tokens[(tokens < 0) | (tokens >= vocab)]
    if len(bad):
        raise ValueError(f"{what} id {int(bad[0])} is not in this model's vocabulary of {vocab}")
