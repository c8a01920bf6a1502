"""One step's sampling, after the forward pass: each row's bias, penalties and guide mask, the draw,
the raw logprobs of the rows that ask and the prompt logprobs of the chunks that ask, with one read
of the device for all of it. Called by ``Engine._forward`` on the engine thread.

``Tracked`` is the per-sequence state the engine keeps beside the scheduler's ``Request`` (so it
survives preemption): the detokenizer, the generator, the guide's matcher, and the logprobs waiting
for their output.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from stages.engine.detokenizer import Detokenizer
from stages.engine.guide import GuideMatcher
from stages.engine.logits_processing import RowInputs, process_logits
from stages.engine.logprob_tensors import gather_logprobs, prompt_logprobs, read_together, token_logprobs
from stages.engine.logprobs import TokenLogprob
from stages.engine.request import Request
from stages.engine.sampler import SamplingError, draw_rows, results


@dataclass
class Tracked:
    """Per-sequence state the engine keeps beside the scheduler's ``Request`` (it survives preemption).

    ``matcher``: the guide's, advanced past every appended token. ``logprob``: the logprobs of the
    token about to be appended (set by ``sample_step``; for a decode's first token, by
    ``Engine.add_prefilled`` from the prefill's), taken by that token's output. ``prompt_logprobs``:
    while the prompt is computed, one entry per prompt position (position 0 None), filled chunk by
    chunk; taken by the first output with a token (None once taken, or when not asked; a decode's
    come from its prefill).
    """

    detokenizer: Detokenizer
    generator: torch.Generator
    matcher: GuideMatcher | None = None
    logprob: TokenLogprob | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None


# a prefill chunk whose prompt logprobs are asked for: the request, its state, the chunk's first
# position, and the hidden states of the chunk's positions that predict a prompt token
PromptChunk = tuple[Request, Tracked, int, torch.Tensor]


@torch.inference_mode()  # the runner's logits are inference tensors, processed in place
def sample_step(rows: list[tuple[Request, Tracked]], logits: torch.Tensor, chunks: list[PromptChunk],
                lm_head: Callable[[torch.Tensor], torch.Tensor], errors: dict[str, str]) -> dict[str, int]:
    """Draw a token for each of ``rows`` from its row of ``logits`` after its bias, penalties and guide
    mask (``process_logits``; in place), with the raw logprobs of the rows that ask, and the prompt
    logprobs of ``chunks`` (``lm_head``: hidden states -> logits), reading the device once. Logprobs
    go to each ``Tracked``; returns the tokens of the rows that succeed and records why the others
    failed in ``errors`` (one row's failure is its own)."""
    params = [request.params for request, _ in rows]
    asking = [i for i, p in enumerate(params) if p.logprobs is not None]
    raw = logits[asking].log_softmax(-1) if asking else None  # before any processing
    failed = process_logits(logits, [RowInputs(i, r.params, r.prompt.token_ids, r.output_ids, t.matcher)
                                     for i, (r, t) in enumerate(rows) if r.params.processes_logits])
    drawn = draw_rows(logits, params, [t.generator for _, t in rows])
    width = max((params[i].logprobs or 0 for i in asking), default=0)
    reads = [drawn.tokens, drawn.verdicts] + ([] if raw is None else gather_logprobs(raw, drawn.tokens[asking], width))
    prompts: list[tuple[Request, Tracked, int, list[int]]] = []
    at = len(reads)  # where the prompts' tensors start, three each
    for request, tracked, first, hidden in chunks:
        targets = request.prompt.token_ids[first + 1:first + 1 + hidden.shape[0]]
        try:
            reads += prompt_logprobs(hidden, lm_head, torch.tensor(targets, dtype=torch.long, device=logits.device),
                                     request.params.prompt_logprobs or 0)
            prompts.append((request, tracked, first, targets))
        except Exception as exc:  # noqa: BLE001 - this request's failure only
            errors[request.request_id] = f"prompt logprobs failed: {type(exc).__name__}: {exc}"
    values = read_together(reads)  # the step's one read of the device
    ids, verdicts = [int(v) for v in values[0]], [int(v) for v in values[1]]
    if raw is not None:
        for i, logprob in zip(asking, token_logprobs([ids[i] for i in asking], values[2:5], width,
                                                       [params[i].logprobs or 0 for i in asking])):
            rows[i][1].logprob = logprob
    for request, tracked, first, targets in prompts:
        k = request.params.prompt_logprobs or 0
        if tracked.prompt_logprobs is not None:
            tracked.prompt_logprobs[first + 1:first + 1 + len(targets)] = token_logprobs(targets, values[at:at + 3], k,
                                                                                         [k] * len(targets))
        at += 3
    tokens: dict[str, int] = {}
    for row, ((request, _), token) in enumerate(zip(rows, results(drawn, ids, verdicts, params, logits.dtype))):
        if row in failed:
            errors[request.request_id] = failed[row]
        elif isinstance(token, SamplingError):
            errors[request.request_id] = f"SamplingError: {token}"
        elif request.request_id not in errors:
            tokens[request.request_id] = token
    return tokens
