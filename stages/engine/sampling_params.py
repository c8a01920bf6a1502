"""Sampling parameters of one request, validated at construction."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from stages.engine.guide import Guide

SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed takes
MAX_N = 8  # sequences per request
MAX_LOGPROBS = 20  # most likely tokens reported per position (OpenAI's top_logprobs limit)
MAX_LOGIT_BIAS = 100.0  # |bias| per token, as OpenAI


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    ``temperature == 0`` is greedy decoding (top_p/top_k/seed then have no effect). ``top_k == 0``
    disables top-k. ``stop`` strings are matched on the decoded text and are not part of the output;
    ``stop_token_ids`` and the model's end-of-sequence ids end the request without being shown.

    ``n`` sequences share the prompt (computed once); sequence ``i`` of a seeded request draws from
    ``seed + i`` (vLLM's rule). Penalties and ``logit_bias`` follow vLLM: ``logit_bias`` is added
    to the logits first; then ``repetition_penalty`` divides positive (multiplies negative) logits of
    every token in the prompt or the output so far, ``frequency_penalty`` subtracts itself times each
    token's count in the output, ``presence_penalty`` subtracts itself once per token present in the
    output; then the ``guide``'s mask; then temperature, top-k, top-p. They apply to greedy rows too.
    ``logprobs`` (k): each sampled token's log-probability and the k most likely, from the model's raw
    logits (``log_softmax`` before any of the above, vLLM's "raw_logprobs"); ``prompt_logprobs``
    the same for every prompt token after the first. ``guide``: a compiled grammar every token obeys.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), ids distinct
    logprobs: int | None = None  # None: none; k in [0, MAX_LOGPROBS]
    prompt_logprobs: int | None = None  # None: none; k in [0, MAX_LOGPROBS]
    guide: Guide | None = None

    def __post_init__(self) -> None:
        if self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.seed is not None and not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
            raise ValueError(f"seed must be in [-2**63, 2**64 - 1], got {self.seed}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be in [1, {MAX_N}], got {self.n}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        if any(not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS for _, bias in self.logit_bias):
            raise ValueError(f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
        if len({token for token, _ in self.logit_bias}) != len(self.logit_bias):
            raise ValueError("logit_bias names a token twice")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and not 0 <= k <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def processes_logits(self) -> bool:
        """Whether anything changes the logits before temperature (penalties, bias, a guide)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.guide is not None)

    def seed_of(self, index: int) -> int | None:
        """The seed of sequence ``index`` (of ``n``): ``seed + index``, wrapped into torch's range."""
        if self.seed is None:
            return None
        low, high = SEED_RANGE
        return (self.seed + index - low) % (high - low + 1) + low
