"""Who a failure is charged to while a partner has not answered (router/dispatch/dispatcher.py's
_encoder_behind and _decode_behind): a prefill's image failure gives way to the encoder's own
busy answer; a prefill whose decode never came, or whose write into a silent decode failed,
charges the decode. In-process: no sockets."""

from __future__ import annotations

import asyncio
import time

import pytest

from router.dispatch.dispatcher import PEER_GRACE_S, _decode_behind, _encoder_behind
from router.dispatch.verdict import Failure, idle
from router.fleet.workers import Worker
from router.plan.modes import Plan, Target
from router.upstream.client import StageError
from tests.support.router_epd import worker


def _image_plan() -> tuple[Plan, dict[str, Worker]]:
    workers = {role: worker(f"http://{role}:1", role) for role in ("encoder", "prefill", "decode")}
    plan = Plan(Target("decode", workers["decode"], b""),
                (Target("encoder", workers["encoder"], b""), Target("prefill", workers["prefill"], b"")),
                room=7, images={"k" * 64: "http://encoder:1"})
    return plan, workers


def _failed(failure: Failure) -> asyncio.Future:
    future = asyncio.get_running_loop().create_future()
    future.set_exception(StageError(failure))
    return future


@pytest.mark.unit
async def test_a_prefills_image_failure_gives_way_to_the_encoders_own_busy_answer():
    plan, _ = _image_plan()
    reported = StageError(Failure("prefill", "http://prefill:1", 502, "the image failed", "encode_failed",
                                  image_key="k" * 64))
    encoder = asyncio.get_running_loop().create_future()
    busy = Failure("encoder", "http://encoder:1", 503, "busy", "server_overloaded", retry_after="1")
    asyncio.get_running_loop().call_later(0.05, encoder.set_exception, StageError(busy))
    cause = await _encoder_behind(plan, [encoder, _failed(reported.failure)], reported)
    assert isinstance(cause, StageError) and cause.failure is busy


@pytest.mark.unit
async def test_a_prefills_image_failure_stands_when_the_encoder_answered_well_or_not_at_all():
    plan, _ = _image_plan()
    reported = StageError(Failure("prefill", "http://prefill:1", 502, "the image failed", "encode_failed",
                                  image_key="k" * 64))
    answered = asyncio.get_running_loop().create_future()
    answered.set_result(0.01)
    assert await _encoder_behind(plan, [answered, _failed(reported.failure)], reported) is reported
    other_key = StageError(Failure("prefill", "http://prefill:1", 502, "x", "encode_failed", image_key="f" * 64))
    assert await _encoder_behind(plan, [answered, _failed(other_key.failure)], other_key) is other_key
    not_image = StageError(Failure("prefill", "http://prefill:1", 500, "x", "internal_error"))
    assert await _encoder_behind(plan, [answered, _failed(not_image.failure)], not_image) is not_image


async def test_a_prefill_whose_decode_never_came_charges_the_decode_while_it_has_not_answered():
    plan, _ = _image_plan()
    never = StageError(Failure("prefill", "http://prefill:1", 504, "partner never arrived within 5 s", "room_timeout",
                               room=7))
    pending = asyncio.get_running_loop().create_future()
    blamed = await _decode_behind(plan, pending, never)
    assert isinstance(blamed, StageError)
    assert (blamed.failure.stage, blamed.failure.url, blamed.failure.code) == ("decode", "http://decode:1",
                                                                                "room_timeout")
    answered = asyncio.get_running_loop().create_future()
    answered.set_result(None)
    assert await _decode_behind(plan, answered, never) is never  # the decode answered: the prefill's own word stands
    own = StageError(Failure("prefill", "http://prefill:1", 500, "x", "internal_error"))
    assert await _decode_behind(plan, pending, own) is own
    write = StageError(Failure("prefill", "http://prefill:1", 502, "KV transfer failed: peer dead", "kv_transfer_failed",
                               room=7))  # its write into a frozen decode failed
    started = time.monotonic()
    blamed = await _decode_behind(plan, pending, write)  # the decode stays silent for PEER_GRACE_S
    assert time.monotonic() - started >= PEER_GRACE_S
    assert isinstance(blamed, StageError)
    assert (blamed.failure.stage, blamed.failure.url, blamed.failure.code) == ("decode", "http://decode:1",
                                                                                "kv_transfer_failed")
    assert await _decode_behind(plan, answered, write) is write  # a live decode answered: the prefill's own fault
    late = asyncio.get_running_loop().create_future()
    asyncio.get_running_loop().call_later(0.05, late.set_result, None)
    assert await _decode_behind(plan, late, write) is write  # ... also when it answers within the grace
    went_idle = _failed(idle("decode", "http://decode:1", 6.0))  # a frozen decode's stream, cut by the router
    blamed = await _decode_behind(plan, went_idle, write)
    assert isinstance(blamed, StageError) and (blamed.failure.stage, blamed.failure.code) == ("decode",
                                                                                             "kv_transfer_failed")
    assert await _decode_behind(plan, went_idle, never) is not never  # nor does it speak for a partner never come
    pending.cancel()


@pytest.mark.unit
@pytest.mark.parametrize("code", ["encode_abandoned", "image_not_cached"])
async def test_a_claim_that_ended_untaken_while_its_encoder_stayed_silent_charges_that_encoder(code):
    """A lapsed untaken claim is back-pressure to the prefill; with the encoder's own call silent
    ``PEER_GRACE_S`` more (a frozen or cut-off host: a busy one refuses at once), it is the encoder's
    silence: charged to it (no Retry-After), so the retry takes its claim over for another encoder."""
    plan, _ = _image_plan()
    reported = StageError(Failure("prefill", "http://prefill:1", 503, "lapsed", code, retry_after="1", room=7,
                                  image_key="k" * 64))
    silent = asyncio.get_running_loop().create_future()
    started = time.monotonic()
    cause = await _encoder_behind(plan, [silent, _failed(reported.failure)], reported)
    assert PEER_GRACE_S <= time.monotonic() - started < PEER_GRACE_S + 0.5
    assert isinstance(cause, StageError) and not cause.failure.busy
    assert (cause.failure.stage, cause.failure.url, cause.failure.status, cause.failure.code, cause.failure.room,
            cause.failure.image_key) == ("encoder", "http://encoder:1", 504, "upstream_timeout", 7, "k" * 64)
    answered = asyncio.get_running_loop().create_future()
    answered.set_result(0.01)  # it answered (it took the image, or never needed it): back-pressure as reported
    assert await _encoder_behind(plan, [answered, _failed(reported.failure)], reported) is reported
    silent.cancel()
