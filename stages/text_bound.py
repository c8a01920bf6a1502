"""How many tokens a text makes at least, from its length alone: the bound that lets a stage refuse a
prompt that cannot fit its context before tokenizing (or even building) all of it.

A text of C characters makes at least C / L tokens, where L is the most characters of input one
token can stand for. ``chars_per_token`` derives L from a Hugging Face fast tokenizer's JSON
(``tokenizer.backend_tokenizer.to_str()``):

- the longest vocabulary entry or added token, in characters. Byte-level BPE writes each byte as
  one character, so an entry of n characters covers at most n bytes, hence at most n characters;
  prefixes and markers (``##``, ``<0x41>``, ``▁``) only make the bound looser;
- times what the normalizer can shrink: NFC/NFKC compose at most ``COMPOSITION`` characters into
  one, NFD/NFKD, lowercasing and prepending never shrink, a literal ``Replace`` shrinks by its
  pattern over its content;
- None (no bound) when a character can vanish or a run of them can become one token: an added
  token that strips the whitespace beside it, a normalizer
  that drops characters (BERT's cleaning, accent stripping, ``Strip``, a precompiled charsmap, a
  regex ``Replace``), a pre-tokenizer that drops them (whitespace splitting, ``Split`` with
  ``Removed``), an unknown token that can swallow a run (BPE's ``fuse_unk``, WordPiece's
  whole-word unknown, WordLevel, Unigram) or a character outside the vocabulary can vanish (BPE
  without an unknown token), unless byte fallback or a byte-level alphabet rules it out.

What counts as the prompt's text (``prompt_chars``): the chat template writes every message's text
into the prompt, possibly trimming whitespace at its ends, except an assistant's (reasoning
templates drop part of it); the template's own text and image placeholders only add tokens. A
prompt needs one completion token besides, so a text is refused when C > (context - 1) * L.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

COMPOSITION = 4  # the longest canonical decomposition: NFC/NFKC compose at most 4 characters into one
_SAME_LENGTH_NORMALIZERS = {"NFD", "NFKD", "Lowercase", "Prepend"}
_COMPOSING_NORMALIZERS = {"NFC", "NFKC"}
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Punctuation", "UnicodeScripts", "Split"}
_NON_SPACE = re.compile(r"\S")
_TAIL_BLOCK = 4096


@dataclass(frozen=True)
class TextBound:
    """A context of ``max_model_len`` tokens and a tokenizer whose tokens cover at most
    ``chars_per_token`` characters each."""

    max_model_len: int
    chars_per_token: int

    @property
    def max_chars(self) -> int:
        """The most characters of text a prompt can hold and still leave one completion token."""
        return (self.max_model_len - 1) * self.chars_per_token

    def min_tokens(self, chars: int) -> int:
        return -(-chars // self.chars_per_token)


def chars_per_token(spec: dict) -> int | None:
    """L for a tokenizer given as its ``tokenizer.json`` dict, or None when no such bound holds."""
    shrink = _normalizer_shrink(spec.get("normalizer"))
    if shrink is None or not _pre_tokenizer_keeps(spec.get("pre_tokenizer")) or _unknown_swallows(spec):
        return None
    if any(added.get("lstrip") or added.get("rstrip") for added in spec.get("added_tokens") or ()):
        return None  # such a token also takes the whitespace run beside it
    longest = max((len(token) for token in _tokens(spec)), default=0)
    return max(1, longest) * shrink


def prompt_chars(messages: Iterable[tuple[object, Iterable[object]]]) -> int:
    """Characters of text the prompt holds at least: for each (role, texts) of a conversation, every
    str text less its leading and trailing whitespace, assistant messages left out."""
    return sum(kept_chars(text) for role, texts in messages if role != "assistant"
               for text in texts if isinstance(text, str))


def kept_chars(text: str) -> int:
    """``len(text.strip())`` without copying ``text``."""
    first = _NON_SPACE.search(text)
    if first is None:
        return 0
    end = len(text)
    while True:
        start = max(0, end - _TAIL_BLOCK)
        kept = len(text[start:end].rstrip())
        if kept:
            return start + kept - first.start()
        end = start


def _tokens(spec: dict) -> Iterable[str]:
    model = spec.get("model") or {}
    vocab = model.get("vocab") or {}
    yield from (vocab if isinstance(vocab, dict) else (entry[0] for entry in vocab))  # Unigram: [piece, score]
    yield from (added["content"] for added in spec.get("added_tokens") or ())


def _normalizer_shrink(normalizer: dict | None) -> int | None:
    """How many input characters one normalized character can come from (None: unbounded)."""
    if normalizer is None:
        return 1
    kind = normalizer.get("type")
    if kind == "Sequence":
        total = 1
        for part in normalizer.get("normalizers", ()):
            factor = _normalizer_shrink(part)
            if factor is None:
                return None
            total *= factor
        return total
    if kind in _SAME_LENGTH_NORMALIZERS:
        return 1
    if kind in _COMPOSING_NORMALIZERS:
        return COMPOSITION
    if kind == "Replace":
        pattern, content = (normalizer.get("pattern") or {}).get("String"), normalizer.get("content") or ""
        return -(-len(pattern) // len(content)) if pattern and content else None
    return None


def _pre_tokenizer_keeps(pre_tokenizer: dict | None) -> bool:
    """Whether every input character ends up in some token."""
    if pre_tokenizer is None:
        return True
    kind = pre_tokenizer.get("type")
    if kind == "Sequence":
        return all(_pre_tokenizer_keeps(part) for part in pre_tokenizer.get("pretokenizers", ()))
    if kind == "Split":
        return pre_tokenizer.get("behavior") != "Removed"
    return kind in _KEEPING_PRE_TOKENIZERS


def _unknown_swallows(spec: dict) -> bool:
    """Whether a character outside the vocabulary can vanish or join a run under one unknown token.
    Only BPE is safe, and only with a byte-level alphabet, byte fallback or an unfused unknown token:
    WordLevel, WordPiece and Unigram may turn a whole word into one unknown token."""
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        return True
    if model.get("byte_fallback") or _byte_level(spec.get("pre_tokenizer")):
        return False
    return model.get("unk_token") is None or bool(model.get("fuse_unk"))


def _byte_level(pre_tokenizer: dict | None) -> bool:
    if pre_tokenizer is None:
        return False
    if pre_tokenizer.get("type") == "Sequence":
        return any(_byte_level(part) for part in pre_tokenizer.get("pretokenizers", ()))
    return pre_tokenizer.get("type") == "ByteLevel"
