"""Probe a Mooncake peer's handshake daemon before the first write to it, so that a stalled peer
cannot freeze every write of this process.

Why: the first ``batch_transfer_sync_write`` to a target opens its segment with a socket handshake,
and the Python binding does that while holding the one mutex every write takes (0.3.13:
``TransferEnginePy::batchTransferSync``). A peer that is stopped, not dead, holds that handshake for
the library's 60 s receive timeout, so writes to every other peer wait behind it. ``send_probe``
talks to the same daemon without that mutex (and without the GIL): once it has answered, the
peer was alive a moment ago and the handshake that follows is quick.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from transfer.base import TransferError


@dataclass(eq=False)
class _Probe:
    done: threading.Event = field(default_factory=threading.Event)
    rc: int | None = None  # send_probe's answer once done; None if it raised


class Handshakes:
    """Which peers have answered a probe since their last failed write. Contract (any thread):

    - ``ensure(key, deadline)`` returns at once for a peer that answered; otherwise it probes the
      peer (one probe per peer at a time: a caller that finds one running waits for it) and returns
      once the peer answered, or raises TransferError at ``deadline`` or when the probe failed;
    - ``failed(key)`` after a write to the peer failed, so the next write probes again (the binding
      may have dropped the segment, or the peer stalled).

    ``run(fn, deadline, what)`` runs the probe (the backend's worker pool: a probe of a stalled peer
    is abandoned at the deadline and keeps its thread until the library gives up).
    """

    def __init__(self, probe: Callable[[str], int],
                 run: Callable[[Callable[[], None], float, str], None]) -> None:
        self._probe = probe
        self._run = run
        self._lock = threading.Lock()
        self._probes: dict[str, _Probe] = {}  # a failed probe is dropped when it ends

    def ensure(self, key: str, deadline: float) -> None:
        with self._lock:
            probe = self._probes.get(key)
            mine = probe is None
            if probe is None:
                probe = self._probes[key] = _Probe()
        if mine:
            self._run(lambda: self._answer(key, probe), deadline, f"mooncake handshake probe of {key}")
        elif not probe.done.wait(max(0.0, deadline - time.monotonic())):
            raise TransferError(f"mooncake: {key} has not answered a handshake probe in time "
                                f"(TransferConfig.timeout_s); the peer is stalled or unreachable")
        if probe.rc != 0:
            raise TransferError(f"mooncake: handshake probe of {key} failed with code {probe.rc} (peer dead or "
                                f"unreachable)")

    def failed(self, key: str) -> None:
        with self._lock:
            probe = self._probes.get(key)
            if probe is not None and probe.done.is_set():
                del self._probes[key]  # a probe still running stays: one per peer at a time

    def _answer(self, key: str, probe: _Probe) -> None:
        """Runs on a worker thread, maybe long after its caller gave up: records the probe's answer."""
        try:
            probe.rc = self._probe(key)
        finally:
            with self._lock:
                if probe.rc != 0 and self._probes.get(key) is probe:
                    del self._probes[key]  # the next write probes afresh
            probe.done.set()
