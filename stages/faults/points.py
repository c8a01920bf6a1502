"""The fault points by name, what each does (``POINTS``), and the table of armed ones (``Faults``).

Contract: the seam at a fault point calls ``faults.take(point)``; it returns the armed ``Fault``
(and counts one use) or None, and the seam does what the point's description says. ``take`` is
thread-safe (the engine and encoder threads and transfer workers call it).
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from typing import NoReturn

log = logging.getLogger(__name__)
POINTS: dict[str, str] = {
    "prefill.exit_before_forward": "the prefill process exits (code 17) once a room's inputs are ready, before its forward pass (which starts on the HTTP half's arrival, paired or not)",
    "prefill.exit_after_forward": "the prefill process exits (code 17) after the forward pass, before the KV write",
    "prefill.fail_kv_write": "the KV write fails as a transfer error (the transfer backend's write raises "
                             "TransferError); nothing is written into the decode's blocks",
    "prefill.crash": "an unexpected RuntimeError is raised in the prefill path after the forward pass, before "
                     "the KV write (not a transfer error: the prefill answers 500, the decode gets KVFailed)",
    "prefill.delay_ready": "the prefill sleeps delay_s after the KV write, before sending KVReady (an abort "
                           "that arrives meanwhile is answered after the sleep)",
    "prefill.receive_loop_crash": "the prefill's bootstrap receive loop raises RuntimeError and dies",
    "decode.exit_before_request": "the decode process exits (code 17) after reserving blocks, before asking for KV",
    "engine.thread_crash": "the engine thread raises RuntimeError between steps and dies",
    "engine.stall": "the engine thread sleeps delay_s before its next step that has work (a request to run); "
                    "an idle engine leaves it armed, so the stall starts with the work it delays",
    "http.crash": "the next chat or encode request raises RuntimeError once its body has been read: an "
                  "unexpected exception in the route, answered 500 internal_error on a connection that stays open",
    "stream.slow_token": "each output of a stream (chat or completions; decode, colocated) is held delay_s before "
                         "it is sent, one use per output; the event loop runs meanwhile, so keep-alive comments "
                         "flow: a slow but live stage",
    "encoder.stall": "the encoder thread sleeps delay_s after taking a batch, before its vision-tower call "
                     "(work arriving meanwhile stays queued)",
    "encoder.crash": "the next vision-tower call raises RuntimeError (its images fail; the encoder stays up)",
    "encoder.exit_mid_encode": "the encoder process exits (code 17) during a vision-tower call",
}
EXIT_CODE = 17


@dataclass
class Fault:
    point: str
    times: int = 1  # uses left
    delay_s: float = 0.0

    def __post_init__(self) -> None:
        if self.point not in POINTS:
            raise ValueError(f"unknown fault point {self.point!r}; known: {sorted(POINTS)}")
        if self.times < 1:
            raise ValueError(f"times must be >= 1, got {self.times}")
        if not 0 <= self.delay_s <= 600:
            raise ValueError(f"delay_s must be in [0, 600], got {self.delay_s}")


class Faults:
    """The points armed in this process, each with its uses left. Made only with ``--debug-faults``."""

    def __init__(self) -> None:
        self._armed: dict[str, Fault] = {}
        self._lock = threading.Lock()

    def arm(self, fault: Fault) -> None:
        with self._lock:
            self._armed[fault.point] = fault

    def take(self, point: str) -> Fault | None:
        with self._lock:
            fault = self._armed.get(point)
            if fault is None:
                return None
            fault.times -= 1
            if fault.times == 0:
                del self._armed[point]
            return fault

    def armed(self) -> list[dict]:
        with self._lock:
            return [{"point": f.point, "times": f.times, "delay_s": f.delay_s} for f in self._armed.values()]


def exit_now(point: str) -> NoReturn:
    """End the process at once with ``EXIT_CODE`` (no cleanup, as a crash would), saying which point did."""
    log.error("fault point %s: exiting with code %d", point, EXIT_CODE)
    os._exit(EXIT_CODE)
