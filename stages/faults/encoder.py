"""The ``encoder.*`` fault points, plugged into the encoder worker's hooks (``stages.encoder.worker.EncoderHooks``)."""

from __future__ import annotations

import time

from stages.encoder.batcher import Job
from stages.encoder.worker import EncoderHooks
from stages.faults.points import Faults, exit_now


class FaultyEncoder(EncoderHooks):
    def __init__(self, faults: Faults) -> None:
        self.faults = faults

    def batch_taken(self, batch: list[Job]) -> None:
        stall = self.faults.take("encoder.stall")
        if stall is not None:
            time.sleep(stall.delay_s)

    def before_encode(self, batch: list[Job]) -> None:
        if self.faults.take("encoder.exit_mid_encode"):
            exit_now("encoder.exit_mid_encode")
        if self.faults.take("encoder.crash"):
            raise RuntimeError("fault point encoder.crash")
