"""Log-probabilities of sampled and prompt tokens, as the engine reports them and as they cross P -> D.

A ``TokenLogprob`` is one position: the token there, its log-probability, and the ``k`` most likely
tokens with theirs (``SamplingParams.logprobs`` / ``prompt_logprobs``). Values are ``log_softmax`` of
the model's raw float32 logits, before penalties, bias, grammar mask and temperature (vLLM's
"raw_logprobs"). A msgspec array-like struct, so that a prefill's first-token logprobs ride in
``KVReady`` compactly and nothing is pickled.
"""

from __future__ import annotations

import msgspec


class TokenLogprob(msgspec.Struct, frozen=True, array_like=True):
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = []  # the k most likely (token id, logprob), most likely first
