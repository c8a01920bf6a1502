"""A prompt of common words sized to a number of tokens with the checkpoint's own tokenizer and chat
template (the TTFT benchmarks' long prompts)."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any


def sized_words(prompt_tokens: Callable[[str], int], prefix: str, target_tokens: int,
                seed: int) -> tuple[str, int]:
    """``prefix`` and common words (drawn with ``seed``), as many as bring ``prompt_tokens(text)``
    within 8 tokens of ``target_tokens`` (words are ~1 token each: a few steps); the text and its
    measured length."""
    from stages.modelgen.corpus import _COMMON

    rng = random.Random(seed)
    words = [rng.choice(_COMMON) for _ in range(4 * target_tokens)]
    n = target_tokens
    for _ in range(6):
        text = prefix + " ".join(words[:n])
        got = prompt_tokens(text)
        if abs(got - target_tokens) <= 8:
            break
        n = max(1, n + (target_tokens - got))
    return text, got


def chat_tokens(tokenizer: Any, messages: list[dict]) -> int:
    """Prompt tokens of ``messages`` with ``tokenizer``'s chat template and the generation prompt."""
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    return len(ids["input_ids"] if hasattr(ids, "keys") else ids)
