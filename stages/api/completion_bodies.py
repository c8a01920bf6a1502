"""The bodies of ``/v1/completions`` answers: the completion, its stream chunks, and logprobs in the
legacy format. Pure (token texts are looked up by the ``TokenText`` passed in).

Legacy logprobs (OpenAI's completions API, as vLLM writes them): ``tokens`` (each token's own text,
decoded alone: ``stages.api.token_text``), ``token_logprobs``, ``top_logprobs`` (per token a dict of the k most likely
tokens' texts and the chosen token's -> logprob, so up to k + 1 entries; null where the logprob is),
``text_offset`` (each token's offset in the choice's text: the sum of the earlier tokens' text lengths,
from ``offset``). Logprobs below ``FLOOR`` are written as ``FLOOR`` (-inf is not JSON).
"""

from __future__ import annotations

from collections.abc import Sequence

from stages.api.chat_response import TokenText
from stages.engine.logprobs import TokenLogprob

FLOOR = -9999.0  # vLLM's floor for a logprob in JSON


def _lp(value: float) -> float:
    return max(value, FLOOR)


def legacy_logprobs(entries: Sequence[TokenLogprob | None], token_ids: Sequence[int], token_text: TokenText,
                    k: int, offset: int = 0) -> dict:
    """The legacy logprobs object of ``token_ids`` (``entries[i]`` for ``token_ids[i]``; None: unknown,
    as the prompt's first token), their texts starting at ``offset`` in the choice's text."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []
    for token_id, entry in zip(token_ids, entries, strict=True):
        text = token_text(token_id)[0]
        tokens.append(text)
        text_offset.append(offset)
        offset += len(text)
        if entry is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(_lp(entry.logprob))
        top = {token_text(top_id)[0]: _lp(value) for top_id, value in entry.top[:k]}
        top.setdefault(text, _lp(entry.logprob))
        top_logprobs.append(top)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": text_offset}


def joined(parts: Sequence[dict]) -> dict:
    """One legacy logprobs object from consecutive pieces of one choice (the prompt's, then each step's)."""
    return {key: [value for part in parts for value in part[key]]
            for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


def choice(index: int, text: str, logprobs: dict | None, finish_reason: str | None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def completion(request_id: str, created: int, model: str, choices: list[dict], usage_body: dict) -> dict:
    """The non-stream answer: ``choices`` in index order, ``usage_body`` over every prompt and choice."""
    return {"id": request_id, "object": "text_completion", "created": created, "model": model,
            "choices": sorted(choices, key=lambda c: c["index"]), "usage": usage_body}


def chunk(request_id: str, created: int, model: str, choices: list[dict], usage_body: dict | None = None) -> dict:
    """One stream chunk: some choices' new text, or (``usage_body``, no choices) the last one."""
    body: dict = {"id": request_id, "object": "text_completion", "created": created, "model": model,
                  "choices": choices}
    if usage_body is not None:
        body["usage"] = usage_body
    return body
