"""What the engine hands back: per step and request a ``RequestOutput``; on demand its ``EngineStats``.
Plain data, no torch."""

from __future__ import annotations

from dataclasses import dataclass, field

from stages.engine.logprobs import TokenLogprob
from stages.engine.request import FinishReason


@dataclass
class RequestOutput:
    """What one step produced for one request: new text and tokens, and how it ended if it did."""

    request_id: str
    text: str  # new visible text (stop tokens and stop strings are not shown)
    token_ids: list[int]  # tokens sampled this step, shown or not
    finish_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    error: str | None = None
    rope_delta: int = 0
    blocks: list[int] | None = None  # a finished hand-off request's blocks, now owned by the caller
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache (here, or on the prefill)
    index: int = 0  # which of the request's ``params.n`` sequences this output belongs to
    logprobs: list[TokenLogprob] | None = None  # one per ``token_ids`` entry when ``params.logprobs`` is set
    prompt_logprobs: list[TokenLogprob | None] | None = None  # the request's first output only (position 0: None)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class EngineStats:
    waiting: int
    running: int
    blocks_used: int  # referenced by live requests (or held for a KV transfer)
    blocks_total: int
    blocks_cached: int = 0  # prefix cache: cached blocks nobody references (evictable)
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache, since start
    prefix_hit_tokens: int = 0  # of those, tokens found there
    preemptions: dict[str, int] = field(default_factory=dict)  # by kind ("recompute", "swap"), since start
