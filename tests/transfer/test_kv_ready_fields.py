"""``KVReady``'s issue 19 fields (``first_tokens``, ``first_logprobs``, ``prompt_logprobs``): they round-trip,
frames with and without them are read by either side of protocol version 2, the wire ``Logprob`` is the
engine's ``TokenLogprob`` byte for byte, ``ready_bytes_bound`` bounds real frames, ``check_ready`` refuses a
frame that lacks what a request asked, and ``stages.disagg.ready`` builds and reads them."""

from __future__ import annotations

import math
import random

import msgspec
import pytest

from stages.disagg.errors import DisaggError
from stages.disagg.ready import check_size, read, ready_message
from stages.engine.outputs import RequestOutput
from stages.engine.logprobs import TokenLogprob
from stages.engine.request import FinishReason
from stages.engine.sampling_params import MAX_LOGPROBS, MAX_N, SamplingParams
from transfer.bootstrap_common import MAX_MESSAGE_BYTES
from transfer.messages import PROTOCOL_VERSION, KVReady, Logprob, check_ready, decode, encode, ready_bytes_bound

pytestmark = pytest.mark.unit


class _KVReadyBefore19(msgspec.Struct, tag="KVReady", frozen=True, kw_only=True):
    """``KVReady`` as version 2 defined it before issue 19 (an older peer)."""

    version: int = PROTOCOL_VERSION
    sent_at: float = 0.0
    room: int
    first_token: int
    rope_delta: int
    prompt_tokens: int
    cached_tokens: int = 0


def _full() -> KVReady:
    return KVReady(room=7, first_token=11, rope_delta=-2, prompt_tokens=3, cached_tokens=0, first_tokens=[11, 12],
                   first_logprobs=[Logprob(11, -0.25, [(11, -0.25), (5, -1.5)]), Logprob(12, -3.0, [(11, -0.25), (5, -1.5)])],
                   prompt_logprobs=[None, Logprob(4, -7.5, [(9, -0.5)]), Logprob(8, -2.0, [(8, -2.0)])])


def test_round_trip_and_older_peers_both_ways() -> None:
    msg = _full()
    assert decode(encode(msg)) == msg
    # an older decode reads the new frame, ignoring the new fields: sequence 0's first token
    old = msgspec.msgpack.decode(encode(msg), type=_KVReadyBefore19)
    assert (old.room, old.first_token, old.rope_delta, old.prompt_tokens) == (7, 11, -2, 3)
    # a newer decode reads an older prefill's frame: defaults, one first token
    back = decode(msgspec.msgpack.encode(_KVReadyBefore19(room=7, first_token=11, rope_delta=0, prompt_tokens=3)))
    assert isinstance(back, KVReady)
    assert (back.first_tokens, back.first_logprobs, back.prompt_logprobs, back.tokens()) == ([], None, None, [11])


def test_wire_logprob_is_the_engines_token_logprob_byte_for_byte() -> None:
    engine = TokenLogprob(151643, -12.625, [(151643, -12.625), (0, -math.inf)])
    wire = Logprob(151643, -12.625, [(151643, -12.625), (0, -math.inf)])
    assert msgspec.msgpack.encode(engine) == msgspec.msgpack.encode(wire)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(wire), type=TokenLogprob) == engine


def _random_logprob(rng: random.Random, k: int) -> Logprob:
    return Logprob(rng.randrange(2**32), -rng.random() * 1e4, [(rng.randrange(2**32), -rng.random()) for _ in range(k)])


@pytest.mark.parametrize("n, k, prompt_tokens, prompt_k", [(1, None, 5, None), (MAX_N, MAX_LOGPROBS, 300, MAX_LOGPROBS),
                                                           (3, 0, 1000, 0), (2, 5, 1, 3)])
def test_the_size_bound_holds_for_the_largest_values(n: int, k: int | None, prompt_tokens: int, prompt_k: int | None) -> None:
    rng = random.Random(n)
    msg = KVReady(room=2**63 - 1, first_token=2**32 - 1, rope_delta=-(2**31), prompt_tokens=prompt_tokens,
                  cached_tokens=prompt_tokens, sent_at=1e9, first_tokens=[2**32 - 1] * n,
                  first_logprobs=None if k is None else [_random_logprob(rng, k) for _ in range(n)],
                  prompt_logprobs=None if prompt_k is None else
                  [None] + [_random_logprob(rng, prompt_k) for _ in range(prompt_tokens - 1)])
    size = len(encode(msg))
    bound = ready_bytes_bound(n=n, logprobs=k, prompt_tokens=prompt_tokens, prompt_logprobs=prompt_k)
    assert size <= bound < size * 1.2 + 512


def _ready(**changes: object) -> KVReady:
    return msgspec.structs.replace(_full(), **changes)


def test_check_ready_accepts_what_was_asked_and_names_what_is_missing() -> None:
    asked = {"n": 2, "logprobs": 2, "prompt_tokens": 3, "prompt_logprobs": 1}
    assert check_ready(_full(), **asked) is None
    assert check_ready(_ready(first_logprobs=None, prompt_logprobs=None), **{**asked, "logprobs": None,
                                                                              "prompt_logprobs": None}) is None
    older = _ready(first_tokens=[], first_logprobs=None, prompt_logprobs=None)
    assert "1 first token(s) for a request of n=2" in check_ready(older, **asked)
    assert "run the same release" in check_ready(older, **asked)
    assert check_ready(older, n=1, logprobs=None, prompt_tokens=3, prompt_logprobs=None) is None
    assert "first-token logprobs" in check_ready(_ready(first_logprobs=None), **asked)
    assert "do not match" in check_ready(_full(), **{**asked, "logprobs": 1})  # two top entries, one asked
    assert "prompt logprobs" in check_ready(_ready(prompt_logprobs=None), **asked)
    assert "prompt logprobs" in check_ready(_full(), **{**asked, "prompt_tokens": 4})
    assert check_ready(_ready(first_tokens=[12, 11]), **asked) is not None  # [0] must be first_token


def _output(index: int, token: int, logprobs: bool, prompt: bool, blocks: list[int] | None) -> RequestOutput:
    return RequestOutput("r", "x", [token], FinishReason.LENGTH, 3, 1, rope_delta=-2, blocks=blocks, index=index,
                         logprobs=[TokenLogprob(token, -1.0, [(token, -1.0)])] if logprobs else None,
                         prompt_logprobs=[None, TokenLogprob(4, -7.5), TokenLogprob(8, -2.0)] if prompt else None)


def test_the_prefill_builds_and_the_decode_reads_the_same_values() -> None:
    outputs = [_output(0, 11, True, True, [1, 2]), _output(1, 12, True, False, None), _output(2, 13, True, False, None)]
    msg = ready_message(7, outputs)
    assert (msg.first_token, msg.tokens(), msg.rope_delta, msg.prompt_tokens) == (11, [11, 12, 13], -2, 3)
    params = SamplingParams(n=3, logprobs=1, prompt_logprobs=0)
    first = read(7, decode(encode(msg)), 3, params)
    assert first.tokens == [11, 12, 13]
    assert first.logprobs == [o.logprobs[0] for o in outputs]
    assert first.prompt_logprobs == outputs[0].prompt_logprobs
    assert all(type(lp) is TokenLogprob for lp in [*first.logprobs, *first.prompt_logprobs[1:]])
    # not asked: nothing travels, nothing is read
    plain = ready_message(7, [_output(0, 11, False, False, [1])])
    assert (plain.first_logprobs, plain.prompt_logprobs) == (None, None)
    assert read(7, plain, 3, SamplingParams()).logprobs is None
    with pytest.raises(DisaggError) as info:
        read(7, plain, 3, SamplingParams(logprobs=0))
    assert info.value.status == 502 and "bootstrap room 7" in str(info.value)


def test_prompt_logprobs_too_big_for_a_frame_are_a_400_before_anything_is_reserved() -> None:
    check_size(100_000, SamplingParams(prompt_logprobs=0))  # 18 bytes a token: 1.7 MiB
    check_size(100_000, SamplingParams(n=MAX_N, logprobs=MAX_LOGPROBS))
    with pytest.raises(DisaggError) as info:
        check_size(MAX_MESSAGE_BYTES // 300, SamplingParams(prompt_logprobs=MAX_LOGPROBS))
    assert (info.value.status, info.value.code) == (400, "prompt_logprobs_too_large")
    assert "fewer top logprobs" in str(info.value)
