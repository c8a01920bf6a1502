"""A token's text and bytes, as the chat answer's ``logprobs`` show them (``token`` and ``bytes``).

``token`` is the token decoded alone (vLLM's choice): a piece of a multi-byte character decodes to
U+FFFD. ``bytes`` are the token's own bytes where the tokenizer is byte-level BPE (Qwen's, GPT-2's):
its pieces of a character join into that character's UTF-8; elsewhere, and for added (special)
tokens, the UTF-8 of the decoded text.
"""

from __future__ import annotations

import functools
from typing import Any

CACHE_SIZE = 1 << 16  # token ids whose text is kept: top_logprobs ask for up to 21 a position


@functools.cache
def _byte_of_char() -> dict[str, int]:
    """The inverse of GPT-2's ``bytes_to_unicode``: each byte-level BPE character to its byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = dict(zip(printable, printable)), 0
    for byte in range(256):
        if byte not in chars:
            chars[byte] = 256 + extra
            extra += 1
    return {chr(char): byte for byte, char in chars.items()}


class TokenText:
    """``token_text(token_id) -> (text, bytes)`` for a Hugging Face tokenizer (``stages.prompt``'s).
    Ids the tokenizer does not know (a model's padded vocabulary) read as ``""`` with no bytes."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self.byte_level = type(decoder).__name__ == "ByteLevel"
        self.added = frozenset(getattr(tokenizer, "added_tokens_decoder", {}))
        self.lookup = functools.lru_cache(maxsize=CACHE_SIZE)(self._lookup)

    def __call__(self, token_id: int) -> tuple[str, list[int] | None]:
        return self.lookup(token_id)

    def _lookup(self, token_id: int) -> tuple[str, list[int] | None]:
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if piece is None:
            return "", None
        text = self.tokenizer.decode([token_id])
        if self.byte_level and token_id not in self.added:
            byte_of = _byte_of_char()
            if all(char in byte_of for char in piece):
                return text, [byte_of[char] for char in piece]
        return text, list(text.encode("utf-8"))


def token_id_text(token_id: int) -> tuple[str, list[int] | None]:
    """Without a tokenizer: vLLM's ``token_id:N`` form (``--return-tokens-as-token-ids``), no bytes."""
    return f"token_id:{token_id}", None
