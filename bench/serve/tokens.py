"""Token counts of a run's requests: the server's ``usage`` where it sent one; otherwise counted here.

Without usage, output tokens are the tokenizer's count of the streamed text (``--tokenizer DIR``, or the
``--model`` directory) or, with no tokenizer, the number of token chunks (one token per chunk, exact for
servers that send one token per event); prompt tokens are the tokenizer's count of the prompt's text
(images not counted), or 0 with no tokenizer. ``Counts.sources`` says which way each was counted."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from bench.serve.client import Outcome
from bench.serve.workload import Request, prompt_text


@dataclass(frozen=True)
class Counts:
    """Per request (in order): prompt and output tokens (0 and 0 for a failed request), and how many
    completed requests were counted each way: ``{"input": {"usage": n, ...}, "output": {...}}``."""

    input_tokens: list[int]
    output_tokens: list[int]
    sources: dict[str, dict[str, int]]


def count(outcomes: list[Outcome], requests: list[Request], tokenizer_dir: str | None) -> Counts:
    """Counts for a run; loads the tokenizer (transformers) only if some answer lacked usage."""
    needs_tokenizer = any(o.ok and (o.output_tokens is None or o.prompt_tokens is None) for o in outcomes)
    tokenizer = load_tokenizer(tokenizer_dir) if needs_tokenizer and tokenizer_dir else None
    inputs, outputs = [], []
    sources: dict[str, Counter] = {"input": Counter(), "output": Counter()}
    for outcome, request in zip(outcomes, requests):
        if not outcome.ok:  # nothing to count: a failed request adds no tokens to any total
            inputs.append(0)
            outputs.append(0)
            continue
        if outcome.prompt_tokens is not None:
            inputs.append(outcome.prompt_tokens)
            sources["input"]["usage"] += 1
        elif tokenizer is not None:
            inputs.append(len(tokenizer.encode(prompt_text(request), add_special_tokens=False)))
            sources["input"]["tokenizer_text_only"] += 1
        else:
            inputs.append(0)
            sources["input"]["unknown"] += 1
        if outcome.output_tokens is not None:
            outputs.append(outcome.output_tokens)
            sources["output"]["usage"] += 1
        elif tokenizer is not None:
            outputs.append(len(tokenizer.encode(outcome.text, add_special_tokens=False)))
            sources["output"]["tokenizer"] += 1
        else:
            outputs.append(outcome.chunks)
            sources["output"]["chunks"] += 1
    return Counts(inputs, outputs, {side: dict(counter) for side, counter in sources.items()})


def load_tokenizer(path: str):
    """``transformers.AutoTokenizer`` from a local directory; ValueError names --tokenizer."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"--tokenizer: cannot load a tokenizer from {path}: {exc}") from None
