"""Log-probabilities on the device, and their one trip to the host, for the rows that ask.

``gather_logprobs`` takes rows of ``log_softmax``-ed raw logits and the token of each row and
gives the token's log-probability and the k most likely (ids and values); ``prompt_logprobs`` does
the same for a prompt chunk's positions from their hidden states, through the LM head a slice of
rows at a time (a long chunk times a large vocabulary would not fit at once). Nothing here reads
the device: the engine reads all of a step's tensors together (``read_together``, one copy) and
turns the values into ``TokenLogprob``s (``token_logprobs``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from stages.engine.logprobs import TokenLogprob

PROMPT_SLICE_ROWS = 256  # prompt positions put through the LM head at once (rows x vocab float32 each)


def gather_logprobs(logprobs: torch.Tensor, targets: torch.Tensor, k: int) -> list[torch.Tensor]:
    """``logprobs`` [R, vocab], ``targets`` [R] -> [chosen [R], top ids [R, k], top values [R, k]]
    (top sorted most likely first)."""
    chosen = logprobs.gather(1, targets.unsqueeze(1)).squeeze(1)
    values, ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0].long())
    return [chosen, ids, values]


def prompt_logprobs(hidden: torch.Tensor, lm_head: Callable[[torch.Tensor], torch.Tensor], targets: torch.Tensor,
                    k: int) -> list[torch.Tensor]:
    """``gather_logprobs`` of ``log_softmax(lm_head(hidden))`` ([P, hidden] -> float32 logits), in slices."""
    parts = [gather_logprobs(lm_head(hidden[start:start + PROMPT_SLICE_ROWS]).float().log_softmax(-1),
                             targets[start:start + PROMPT_SLICE_ROWS], k)
             for start in range(0, hidden.shape[0], PROMPT_SLICE_ROWS)]
    return [torch.cat(column) for column in zip(*parts)] if parts else [
        hidden.new_empty(0), hidden.new_empty((0, k), dtype=torch.long), hidden.new_empty((0, k))]


def read_together(tensors: list[torch.Tensor]) -> list[list[float]]:
    """Each tensor's values, flattened, in one device-to-host copy (as float64: exact for float32 values
    and for token ids)."""
    if not tensors:
        return []
    values = torch.cat([t.reshape(-1).to(torch.float64) for t in tensors]).tolist()
    out, start = [], 0
    for tensor in tensors:
        out.append(values[start:start + tensor.numel()])
        start += tensor.numel()
    return out


def token_logprobs(tokens: list[int], read: list[list[float]], width: int, ks: list[int]) -> list[TokenLogprob]:
    """One ``TokenLogprob`` per row from ``gather_logprobs``' three tensors as read (``width`` = its k;
    row i keeps its first ``ks[i]`` most likely)."""
    chosen, ids, values = read
    return [TokenLogprob(token, lp, [(int(ids[row * width + j]), values[row * width + j]) for j in range(k)])
            for row, (token, lp, k) in enumerate(zip(tokens, chosen, ks))]
