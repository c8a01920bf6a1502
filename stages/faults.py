"""Fault points: named places in a stage server where something can be made to go wrong on purpose,
for tests and fault-injection runs. A feature, not a test hook: documented here, off by default,
enabled only by ``--debug-faults`` (which a server bound to a non-loopback address refuses), and
armed at run time through ``POST /debug/faults {"point": ..., "times": N, "delay_s": S}``.

Contract: code at a fault point calls ``faults.take(point)``; it returns the armed ``Fault`` (and
counts one use) or None, and the caller does what the point's description says. ``take`` is
thread-safe (the engine thread calls it). With the feature off, ``take`` always returns None.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

POINTS: dict[str, str] = {
    "prefill.exit_before_forward": "the prefill process exits (code 17) once a room is paired, before its forward pass",
    "prefill.exit_after_forward": "the prefill process exits (code 17) after the forward pass, before the KV write",
    "prefill.fail_kv_write": "the KV write fails as a transfer error; nothing is written into the decode's blocks",
    "prefill.crash": "an unexpected RuntimeError is raised in the prefill path after the forward pass, before "
                     "the KV write (not a transfer error: the prefill answers 500, the decode gets KVFailed)",
    "prefill.delay_ready": "the prefill sleeps delay_s after the KV write, before sending KVReady (an abort "
                           "that arrives meanwhile is answered after the sleep)",
    "prefill.receive_loop_crash": "the prefill's bootstrap receive loop raises RuntimeError and dies",
    "decode.exit_before_request": "the decode process exits (code 17) after reserving blocks, before asking for KV",
    "engine.thread_crash": "the engine thread raises RuntimeError between steps and dies",
    "engine.stall": "the engine thread sleeps delay_s before its next step that has work (a request to run); "
                    "an idle engine leaves it armed, so the stall starts with the work it delays",
    "http.crash": "the next chat or encode request raises RuntimeError once its body is parsed: an unexpected "
                  "exception, answered 500 internal_error on a connection that stays open",
    "stream.slow_token": "each output of a chat stream (decode, colocated) is held delay_s before it is sent, one "
                         "use per output; the event loop runs meanwhile, so keep-alive comments flow: a slow but "
                         "live stage",
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
    def __init__(self, enabled: bool = False) -> None:
        self.enabled = enabled
        self._armed: dict[str, Fault] = {}
        self._lock = threading.Lock()

    def arm(self, fault: Fault) -> None:
        if not self.enabled:
            raise RuntimeError("fault points are off; start the server with --debug-faults")
        with self._lock:
            self._armed[fault.point] = fault

    def take(self, point: str) -> Fault | None:
        if not self.enabled:
            return None
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


def engine_hook(faults: Faults) -> Callable[[bool], None] | None:
    """The ``before_step`` hook of a server's ``AsyncEngine`` (None with fault points off): runs the
    ``engine.*`` points on the engine thread, which calls it before each step (``busy``) and while
    idle. A crash may come either way; a stall only before a step, so it delays work that is there."""
    if not faults.enabled:
        return None

    def before_step(busy: bool) -> None:
        if faults.take("engine.thread_crash"):
            raise RuntimeError("fault point engine.thread_crash")
        stall = faults.take("engine.stall") if busy else None
        if stall is not None:
            time.sleep(stall.delay_s)

    return before_step
