"""The engine's ``Guide`` and ``GuideMatcher`` over an llguidance matcher.

A ``LlgGuide`` holds one matcher at the grammar's start that is never advanced; each sequence gets
a deep copy of it (cheap: the compiled grammar is shared). Per step ``mask`` has llguidance write
its allowed-token bitmask (one bit per token of the model's vocabulary, end-of-sequence ids
allowed exactly when the grammar may end) into a small int32 buffer, moves those words to the
logits' device and sets every token whose bit is clear to -inf: one unpack and one masked fill on
one row. Tokens the tokenizer does not know (an lm_head wider than the tokenizer) have no bytes, so
their bits are always clear.
"""

from __future__ import annotations

import threading

import llguidance
import torch

_SHIFTS: dict[torch.device, torch.Tensor] = {}  # per device: 0..31, to unpack 32 bits of each word
_SHIFTS_LOCK = threading.Lock()


def _shifts(device: torch.device) -> torch.Tensor:
    shifts = _SHIFTS.get(device)
    if shifts is None:
        with _SHIFTS_LOCK:
            shifts = _SHIFTS.setdefault(device, torch.arange(32, dtype=torch.int32, device=device))
    return shifts


class LlgMatcher:
    """One sequence's position in the grammar (``stages.engine.guide.GuideMatcher``); engine thread only."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self._matcher = matcher
        self._vocab_size = vocab_size
        self._words = torch.zeros((vocab_size + 31) // 32, dtype=torch.int32)

    def mask(self, logits: torch.Tensor) -> None:
        """Set every token the grammar forbids next to -inf in ``logits`` ([vocab], in place)."""
        self._matcher.unsafe_compute_mask_ptr(self._words.data_ptr(), self._words.numel() * 4)
        words = self._words.to(logits.device)
        allowed = ((words.unsqueeze(1) >> _shifts(logits.device)) & 1).view(-1)
        width = min(logits.shape[-1], allowed.numel())
        logits[:width].masked_fill_(allowed[:width] == 0, float("-inf"))
        logits[width:] = float("-inf")

    def accept(self, token_id: int) -> None:
        """Advance past ``token_id``; ValueError (the grammar's first error line) if it is forbidden."""
        if not self._matcher.consume_token(token_id):
            raise ValueError(f"token {token_id} breaks the grammar: {_first_line(self._matcher.get_error())}")

    @property
    def done(self) -> bool:
        """The grammar is complete: it takes no token but end-of-sequence."""
        return self._matcher.is_stopped()


class LlgGuide:
    """A compiled grammar (``stages.engine.guide.Guide``): immutable, shared by the sequences of a request."""

    def __init__(self, start: llguidance.LLMatcher, vocab_size: int) -> None:
        self._start = start
        self._vocab_size = vocab_size

    def matcher(self) -> LlgMatcher:
        return LlgMatcher(self._start.deep_copy(), self._vocab_size)


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else "unknown error"
