"""Train a byte-level BPE tokenizer on the local corpus and wrap it as a transformers fast tokenizer."""

from functools import cache

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from .corpus import sentences
from .specials import SpecialTokens

# The pre-tokenizer split of Qwen2 (GPT-4 style): letters, single digits, punctuation runs, whitespace.
_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+"""
    r"""|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def _corpus_size(vocab_size: int) -> tuple[int, int]:
    """(words, invented words) that give BPE enough distinct material for about `vocab_size` tokens."""
    invented = max(1000, vocab_size * 5 // 4)
    return max(20_000, invented * 4), invented


def train(vocab_size: int, specials: SpecialTokens) -> Tokenizer:
    """A byte-level BPE (any text encodes) whose first ids are `specials.tokens`, in order."""
    return Tokenizer.from_str(_trained(vocab_size, specials))


@cache
def _trained(vocab_size: int, specials: SpecialTokens) -> str:
    """Training is deterministic, so one process trains each tokenizer once (the JSON is immutable)."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(specials.tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    n_words, n_invented = _corpus_size(vocab_size)
    tok.train_from_iterator(sentences(n_words, n_invented), trainer)
    for token in specials.tokens:
        if tok.token_to_id(token) != specials.id(token):
            raise AssertionError(f"special token {token!r} did not land on id {specials.id(token)}")
    return tok.to_str()


def wrap(tok: Tokenizer, specials: SpecialTokens, chat_template: str, max_length: int):
    """The transformers tokenizer (`TokenizersBackend`, formerly `PreTrainedTokenizerFast`).

    It adds no special tokens on its own: the chat template writes BOS where the family wants one.
    """
    from transformers import TokenizersBackend

    named = {specials.bos, specials.eos, specials.pad, specials.unk}
    extra = [t for t in specials.tokens if t not in named]
    return TokenizersBackend(
        tokenizer_object=tok,
        bos_token=specials.bos,
        eos_token=specials.eos,
        pad_token=specials.pad,
        unk_token=specials.unk,
        extra_special_tokens=extra,
        chat_template=chat_template,
        model_max_length=max_length,
        clean_up_tokenization_spaces=False,
    )
