"""What a decode server hands its engine for a request whose prompt was computed elsewhere
(``Engine.add_prefilled``): the request, the blocks its prompt KV was written into, and what the
prefill drew for it. Pure data."""

from __future__ import annotations

from dataclasses import dataclass

from stages.engine.logprobs import TokenLogprob
from stages.engine.multimodal import Prompt
from stages.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class FirstTokens:
    """Each sequence's first token as the prefill drew it (one per ``params.n``, by index); their
    logprobs when the request asked for logprobs; the prompt's logprobs when it asked for those
    (sequence 0's first output carries them)."""

    tokens: list[int]
    logprobs: list[TokenLogprob | None] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass(frozen=True)
class Prefilled:
    """A request whose prompt KV is already in ``blocks`` (from ``Engine.reserve_blocks`` or
    ``reserve_cached``), to be decoded from ``first``. ``rope_delta``: the prompt's, as the prefill
    computed it; ``cached_tokens``: how many prompt tokens the prefill found in its prefix cache,
    reported in the outputs."""

    request_id: str
    prompt: Prompt
    params: SamplingParams
    blocks: list[int]
    first: FirstTokens
    rope_delta: int = 0
    cached_tokens: int = 0
