"""The ``prefill.*`` and ``decode.*`` fault points (but ``prefill.fail_kv_write``: ``stages.faults.transfer``),
plugged into the room coordinators' hooks (``stages.disagg.hooks``)."""

from __future__ import annotations

import asyncio

from stages.disagg.hooks import DecodeHooks, PrefillHooks
from stages.faults.points import Faults, exit_now


class FaultyPrefill(PrefillHooks):
    def __init__(self, faults: Faults) -> None:
        self.faults = faults

    def received(self) -> None:
        if self.faults.take("prefill.receive_loop_crash"):
            raise RuntimeError("fault point prefill.receive_loop_crash")

    def before_forward(self, room: int) -> None:
        if self.faults.take("prefill.exit_before_forward"):
            exit_now("prefill.exit_before_forward")

    def after_forward(self, room: int) -> None:
        if self.faults.take("prefill.exit_after_forward"):
            exit_now("prefill.exit_after_forward")
        if self.faults.take("prefill.crash"):
            raise RuntimeError(f"fault point prefill.crash on room {room}")

    async def before_ready(self, room: int) -> None:
        if delay := self.faults.take("prefill.delay_ready"):
            await asyncio.sleep(delay.delay_s)


class FaultyDecode(DecodeHooks):
    def __init__(self, faults: Faults) -> None:
        self.faults = faults

    def before_kv_request(self, room: int) -> None:
        if self.faults.take("decode.exit_before_request"):
            exit_now("decode.exit_before_request")
