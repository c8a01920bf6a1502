"""What a room's ``KVReady`` carries beside the KV: every sequence's first token, their logprobs and
the prompt's, built on the prefill from its hand-off outputs and read back on the decode.

A request of ``n`` sequences is prefilled once; the prefill samples each sequence's first token from
the prompt's logits (``SamplingParams.seed_of(i)``), so the decode starts n sequences from the one KV
it received. ``logprobs`` asked: each first token's ``TokenLogprob`` travels too (the decode reports
it as its first token's). ``prompt_logprobs`` asked: the prefill computed the prompt, so only it has
them; they travel once, and the decode's first output carries them. The prompt's logprobs are what
can make the frame big (18 + 15 k bytes a prompt token): ``check_size`` refuses a request whose
``KVReady`` could exceed the bootstrap frame limit, with a 400 before anything is reserved.
"""

from __future__ import annotations

from stages.disagg.errors import DisaggError, bad_gateway
from stages.engine.outputs import RequestOutput
from stages.engine.logprobs import TokenLogprob
from stages.engine.prefilled import FirstTokens
from stages.engine.sampling_params import SamplingParams
from transfer.bootstrap_common import MAX_MESSAGE_BYTES
from transfer.messages import KVReady, Logprob, check_ready, ready_bytes_bound


def check_size(prompt_tokens: int, params: SamplingParams) -> None:
    """Raise a 400 (``prompt_logprobs_too_large``) when the room's ``KVReady`` could exceed the bootstrap
    frame limit: prompt logprobs of a prompt too long for the ``k`` asked."""
    size = ready_bytes_bound(n=params.n, logprobs=params.logprobs, prompt_tokens=prompt_tokens,
                             prompt_logprobs=params.prompt_logprobs)
    if size > MAX_MESSAGE_BYTES:
        raise DisaggError(
            400, f"prompt logprobs with {params.prompt_logprobs} top entries for a {prompt_tokens}-token prompt "
                 f"could take {size / 2**20:.1f} MiB, more than the {MAX_MESSAGE_BYTES >> 20} MiB a prefill may "
                 "send its decode; ask for fewer top logprobs or send a shorter prompt",
            "prompt_logprobs_too_large")


def ready_message(room: int, outputs: list[RequestOutput]) -> KVReady:
    """The ``KVReady`` of ``room``, whose hand-off ended in ``outputs`` (one finished output per
    sequence, in index order; the first holds the KV blocks)."""
    first = outputs[0]
    prompt = next((o.prompt_logprobs for o in outputs if o.prompt_logprobs is not None), None)
    logprobs = [o.logprobs[0] for o in outputs if o.logprobs]
    return KVReady(
        room=room, first_token=first.token_ids[0], rope_delta=first.rope_delta, prompt_tokens=first.prompt_tokens,
        cached_tokens=first.cached_tokens, first_tokens=[o.token_ids[0] for o in outputs],
        first_logprobs=[_to_wire(lp) for lp in logprobs] if len(logprobs) == len(outputs) else None,
        prompt_logprobs=[None if lp is None else _to_wire(lp) for lp in prompt] if prompt is not None else None,
    )


def read(room: int, ready: KVReady, prompt_tokens: int, params: SamplingParams) -> FirstTokens:
    """The first tokens and logprobs in ``ready``, what the decode starts the room's sequences from;
    502 when it lacks what ``params`` asked (an older prefill) or does not fit the request."""
    if reason := check_ready(ready, n=params.n, logprobs=params.logprobs, prompt_tokens=prompt_tokens,
                             prompt_logprobs=params.prompt_logprobs):
        raise bad_gateway(f"bootstrap room {room}: {reason}")
    return FirstTokens(
        tokens=ready.tokens(),
        logprobs=[_from_wire(lp) for lp in ready.first_logprobs]
        if params.logprobs is not None and ready.first_logprobs is not None else None,
        prompt_logprobs=[None if lp is None else _from_wire(lp) for lp in ready.prompt_logprobs]
        if params.prompt_logprobs is not None and ready.prompt_logprobs is not None else None,
    )


def _to_wire(lp: TokenLogprob) -> Logprob:
    return Logprob(lp.token_id, lp.logprob, lp.top)


def _from_wire(lp: Logprob) -> TokenLogprob:
    return TokenLogprob(lp.token_id, lp.logprob, lp.top)
