"""The workloads: a short text, one 64x64 image, ~2000 tokens of text (sized with the checkpoint's
tokenizer); each one user turn, streamed, ``ignore_eos``."""

from __future__ import annotations

import random
from pathlib import Path

from bench.common.images import image_url, make_image

WORKLOADS = ("text_short", "image_64", "text_2k")
LONG_TOKENS = 2000  # target prompt length of text_2k


def long_text(model_dir: Path, target_tokens: int) -> tuple[str, int]:
    """Common words (the tokenizer's own training vocabulary) sized to ``target_tokens`` prompt tokens
    with the chat template; returns the text and its measured prompt length."""
    from transformers import AutoTokenizer

    from stages.modelgen.corpus import _COMMON

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rng = random.Random(0)

    def prompt_tokens(text: str) -> int:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                            add_generation_prompt=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return len(ids)

    words = [rng.choice(_COMMON) for _ in range(4 * target_tokens)]
    n = target_tokens
    for _ in range(6):  # words are ~1 token each; converge in a few steps
        text = "Summarize this: " + " ".join(words[:n])
        got = prompt_tokens(text)
        if abs(got - target_tokens) <= 8:
            break
        n = max(1, n + (target_tokens - got))
    return text, got


def chat_body(workload: str, long: str, max_tokens: int) -> dict:
    """The streamed chat body of ``workload`` (``long``: the text of text_2k)."""
    if workload == "text_short":
        content = [{"type": "text", "text": "Hello there! What is the capital of the country with the tallest mountain?"}]
    elif workload == "image_64":
        content = [{"type": "image_url", "image_url": {"url": image_url(make_image(3))}},
                   {"type": "text", "text": "What is in this picture?"}]
    elif workload == "text_2k":
        content = [{"type": "text", "text": long}]
    else:
        raise ValueError(f"unknown workload {workload!r}; choose from {WORKLOADS}")
    return {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
