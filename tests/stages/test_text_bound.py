"""The least number of tokens a text makes, from its length (``stages.text_bound``): checked against
the real tokenizers of every generated model, and the rules for the tokenizer features that void it."""

from __future__ import annotations

import json

import pytest

from stages.prompt import load_tokenizer
from stages.text_bound import COMPOSITION, TextBound, chars_per_token, kept_chars, prompt_chars
from tests.support.generated_models import VARIANTS, model_dir

BYTE_LEVEL_BPE = {"model": {"type": "BPE", "vocab": {"a": 0, "abc": 1}, "unk_token": None},
                  "pre_tokenizer": {"type": "ByteLevel"}, "normalizer": None, "added_tokens": []}


def spec(**changes) -> dict:
    return {**BYTE_LEVEL_BPE, **changes}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_no_text_makes_fewer_tokens_than_the_bound_says(variant):
    """Texts that pack the most characters into each token (runs of one character, long words, added
    tokens, decomposed accents that NFC composes) never beat C / chars_per_token."""
    tokenizer = load_tokenizer(model_dir(variant, "tiny"))
    per_token = chars_per_token(json.loads(tokenizer.backend_tokenizer.to_str()))
    assert per_token is not None
    longest = max(tokenizer.get_vocab(), key=len)
    added = [t.content for t in tokenizer.backend_tokenizer.get_added_tokens_decoder().values()]
    texts = [" " * 5000, "a" * 5000, "\n" * 3000, tokenizer.convert_tokens_to_string([longest]) * 500,
             "".join(added) * 200, "e\u0301" * 2000, "\u03b1\u0313\u0300\u0345" * 1000, "hello world " * 500]
    for text in texts:
        tokens = len(tokenizer(text, add_special_tokens=False)["input_ids"])
        assert tokens >= -(-len(text) // per_token), (variant, text[:20], tokens, len(text), per_token)


@pytest.mark.unit
def test_the_bound_of_a_byte_level_bpe_is_its_longest_token():
    assert chars_per_token(spec()) == 3
    assert chars_per_token(spec(added_tokens=[{"content": "<|longest_added|>"}])) == len("<|longest_added|>")
    assert chars_per_token(spec(normalizer={"type": "NFC"})) == 3 * COMPOSITION
    assert chars_per_token(spec(normalizer={"type": "Sequence", "normalizers": [
        {"type": "Prepend", "prepend": "_"}, {"type": "Replace", "pattern": {"String": " "}, "content": "_"}]})) == 3


@pytest.mark.unit
@pytest.mark.parametrize("change", [
    {"normalizer": {"type": "BertNormalizer"}},  # drops control characters
    {"normalizer": {"type": "Strip"}},
    {"normalizer": {"type": "Replace", "pattern": {"Regex": "\\s+"}, "content": " "}},
    {"normalizer": {"type": "Precompiled"}},
    {"pre_tokenizer": {"type": "Whitespace"}},  # whitespace vanishes
    {"pre_tokenizer": {"type": "Split", "pattern": {"String": " "}, "behavior": "Removed"}},
    {"added_tokens": [{"content": "<mask>", "lstrip": True}]},  # takes the spaces before it
    {"model": {"type": "WordPiece", "vocab": {"a": 0}, "unk_token": "[UNK]"}},  # a whole unknown word, one token
    {"model": {"type": "Unigram", "vocab": [["a", 0.0]]}},
    {"model": {"type": "BPE", "vocab": {"a": 0}, "unk_token": "<unk>", "fuse_unk": True}, "pre_tokenizer": None},
    {"model": {"type": "BPE", "vocab": {"a": 0}, "unk_token": None}, "pre_tokenizer": None},  # unknown: dropped
])
def test_no_bound_where_characters_can_vanish_or_merge(change):
    assert chars_per_token(spec(**change)) is None


@pytest.mark.unit
def test_sentencepiece_bpe_with_byte_fallback_is_bounded():
    model = {"type": "BPE", "vocab": {"<0x41>": 0, "\u2581hello": 1}, "unk_token": "<unk>", "fuse_unk": True,
             "byte_fallback": True}
    assert chars_per_token(spec(model=model, pre_tokenizer={"type": "Metaspace"})) == 6


@pytest.mark.unit
def test_what_counts_as_the_prompts_text():
    assert kept_chars("  a b  \n") == 3 and kept_chars(" \n ") == 0 and kept_chars("x" + " " * 10_000) == 1
    conversation = [("system", ["  sys  "]), ("user", ["hello", None, 5]), ("assistant", ["dropped by templates"]),
                    ("tool", ["ok"])]
    assert prompt_chars(conversation) == 3 + 5 + 2
    bound = TextBound(max_model_len=2048, chars_per_token=16)
    assert bound.max_chars == 2047 * 16 and bound.min_tokens(2047 * 16 + 1) == 2048
