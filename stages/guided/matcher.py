"""The engine's ``Guide`` and ``GuideMatcher`` over an llguidance matcher.

A ``LlgGuide`` holds one matcher at the grammar's start that is never advanced; each sequence gets
a deep copy of it (cheap: the compiled grammar is shared). Per step ``mask`` has llguidance write
its allowed-token bitmask (one bit per token of the model's vocabulary, end-of-sequence ids
allowed exactly when the grammar may end) into a small buffer, unpacks the inverted words into one
byte per token on the host (numpy, microseconds), moves those to the logits' device, turns them into
a bias of 0 or -inf by arithmetic on the bits (1 * the bits of -inf) and adds it to the row: no
branch per token (a masked fill or ``where`` over a scattered mask is ~6x slower on a CPU). Tokens
the tokenizer does not know (an lm_head wider than the tokenizer) have no bytes, so their bits are
always clear.
"""

from __future__ import annotations

import llguidance
import numpy as np
import torch

NEG_INF_BITS = -8388608  # 0xFF800000 as an int32: the bits of float32 -inf


class LlgMatcher:
    """One sequence's position in the grammar (``stages.engine.guide.GuideMatcher``); engine thread only."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self._matcher = matcher
        self._vocab_size = vocab_size
        self._words = np.zeros((vocab_size + 31) // 32, dtype="<u4")  # bit t % 32 of word t // 32: token t

    def mask(self, logits: torch.Tensor) -> None:
        """Set every token the grammar forbids next to -inf in ``logits`` ([vocab], in place)."""
        self._matcher.unsafe_compute_mask_ptr(self._words.ctypes.data, self._words.nbytes)
        width = min(logits.shape[-1], self._vocab_size)
        forbidden = np.unpackbits(np.invert(self._words).view(np.uint8), count=width, bitorder="little")
        bias = torch.from_numpy(forbidden).to(logits.device).to(torch.int32).mul_(NEG_INF_BITS).view(torch.float32)
        logits[:width].add_(bias.to(logits.dtype))  # the engine's logits are float32: no copy
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
