"""The requests: the running streams' short prompts and the arriving long prompts, each long prompt
the same words in another order (so a prefix cache cannot serve one from another). Pure but for
``long_texts``, which sizes the words with the checkpoint's tokenizer."""

from __future__ import annotations

import json
import random
from pathlib import Path

HEAD = "Summarize this: "  # the start of bench.ttft_pd's long text, kept in front of every variant


def long_texts(model_dir: Path, target_tokens: int, count: int) -> tuple[list[str], int]:
    """``count`` texts of ~``target_tokens`` prompt tokens (bench.ttft_pd's sized common words, each
    shuffled by ``variant``) and the measured prompt length of the first."""
    from bench.ttft_pd.workload import long_text

    base, tokens = long_text(model_dir, target_tokens)
    return [variant(base, k) for k in range(count)], tokens


def variant(text: str, k: int) -> str:
    """``text``'s words after ``HEAD`` shuffled with seed ``k`` (``k`` = 0: unchanged)."""
    if k == 0:
        return text
    words = text.removeprefix(HEAD).split()
    random.Random(k).shuffle(words)
    return HEAD + " ".join(words)


def body(model: str, text: str, max_tokens: int) -> dict:
    """A streamed one-turn chat body: greedy, ``ignore_eos`` (exactly ``max_tokens`` tokens), usage."""
    return {"model": model, "messages": [{"role": "user", "content": [{"type": "text", "text": text}]}],
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}


def stream_payload(model: str, stream: int, index: int, max_tokens: int) -> bytes:
    """Request ``index`` of running stream ``stream``: a short question, serialized."""
    text = f"Stream {stream}, request {index}: tell me a long story about the sea."
    return json.dumps(body(model, text, max_tokens)).encode()


def long_payload(model: str, text: str, max_tokens: int) -> bytes:
    return json.dumps(body(model, text, max_tokens)).encode()
