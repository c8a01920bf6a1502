"""Mooncake Transfer Engine backend (``mooncake-transfer-engine``, P2P handshake, TCP or RDMA).

Library facts this file relies on (0.3.13):
- Every call returns an int: 0 (or a positive port/id) is success, a negative value an error code
  (register twice: -7, unregister twice: -3, failed transfer: -1). Errors are also logged via glog.
- ``batch_transfer_sync_write`` releases the GIL and busy-polls until the batch completes, fails, or
  its own timeout passes (env ``MC_TRANSFER_TIMEOUT`` seconds, read when the engine is built, at
  least 5, default 30, plus 1 ns per byte). Before the first write to a target it opens the
  target's segment with a socket handshake that a stalled (not dead) peer holds for about 60 s.
  Neither can be cancelled, so each batch runs on a worker thread and write() stops waiting at its
  deadline (TransferError with ``in_flight=True``); the call ends on its own later (at once when the
  peer dies). A process that exits while such a call still runs aborts ("terminate called without
  an active exception"); release() waits up to ``timeout_s`` for them.
- The TCP transport queues at most ~1024 transfers per peer and fails a batch beyond that, so writes
  go out in batches of MAX_BATCH ops. It also does not check that local buffers are registered.
- A dead peer fails a write within milliseconds (connection refused / reset).
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import msgspec
from mooncake.engine import TransferEngine

from transfer.base import (DESCRIPTOR_VERSION, Peer, RegionDescriptor, TransferBackend, TransferConfig,
                           TransferError, WriteOp, decode_descriptor)

log = logging.getLogger(__name__)
T = TypeVar("T")
MAX_BATCH = 512  # ops per batch_transfer_sync_write; the TCP transport's per-peer queue holds ~1024


class MooncakeDescriptor(RegionDescriptor, frozen=True, kw_only=True):
    protocol: str
    host: str
    rpc_port: int

    @property
    def session_id(self) -> str:
        """Mooncake's name for the target: where its P2P handshake listens."""
        return f"{self.host}:{self.rpc_port}"


class MooncakeBackend(TransferBackend):
    """One ``TransferEngine`` per process with the P2P handshake (no metadata server). ``host`` is
    the address peers dial; Mooncake picks the RPC port. Writes are ``batch_transfer_sync_write``
    calls on worker threads, MAX_BATCH ops each, all under one deadline."""

    name = "mooncake"
    protocols = ("tcp", "rdma")

    def __init__(self, config: TransferConfig) -> None:
        super().__init__(config)
        # The engine's own transfer timeout; set so an abandoned call ends soon after our deadline.
        os.environ.setdefault("MC_TRANSFER_TIMEOUT", str(max(5, math.ceil(config.timeout_s))))
        self._engine: TransferEngine | None = TransferEngine()
        rc = self._engine.initialize(config.host, "P2PHANDSHAKE", config.protocol, config.device)
        if rc != 0:
            raise TransferError(f"mooncake: initialize({config.host!r}, P2PHANDSHAKE, {config.protocol!r}, "
                                f"{config.device!r}) failed with code {rc}; check TransferConfig.host/device")
        self.rpc_port = self._engine.get_rpc_port()
        self._calls = _BoundedCalls()

    def _register(self, ptr: int, length: int) -> None:
        rc = self._live().register_memory(ptr, length)
        if rc != 0:
            raise TransferError(f"mooncake: register_memory({ptr:#x}, {length}) failed with code {rc}")

    def _descriptor(self) -> bytes:
        assert self.region is not None
        return msgspec.msgpack.encode(MooncakeDescriptor(
            backend=self.name, version=DESCRIPTOR_VERSION, base=self.region[0], length=self.region[1],
            protocol=self.config.protocol, host=self.config.host, rpc_port=self.rpc_port))

    def _connect(self, peer_descriptor: bytes) -> Peer:
        desc = decode_descriptor(peer_descriptor, self.name, MooncakeDescriptor)
        if desc.protocol != self.config.protocol:
            raise TransferError(f"mooncake: peer uses protocol {desc.protocol!r}, this process "
                                f"{self.config.protocol!r}; set the same TransferConfig.protocol on both sides")
        return Peer(self.name, desc.session_id, desc.base, desc.length)

    def _write(self, peer: Peer, ops: list[WriteOp], deadline: float) -> None:
        engine = self._live()
        assert self.region is not None
        base = self.region[0]
        for i in range(0, len(ops), MAX_BATCH):
            batch = ops[i:i + MAX_BATCH]
            src = [base + op.local_offset for op in batch]
            dst = [peer.base + op.remote_offset for op in batch]
            lengths = [op.length for op in batch]
            rc = self._calls.call(lambda: engine.batch_transfer_sync_write(peer.key, src, dst, lengths),
                                  deadline, f"mooncake write of {len(batch)} ops to {peer.key}")
            if rc != 0:
                raise TransferError(f"mooncake: batch_transfer_sync_write to {peer.key} failed with code {rc} "
                                    f"(peer dead, unreachable, or region mismatch)")

    def _release(self) -> None:
        left = self._calls.wait_idle(self.config.timeout_s)
        if left:
            log.warning("mooncake: %d abandoned write(s) still running at release; the region must stay "
                        "allocated until they end (MC_TRANSFER_TIMEOUT)", left)
        if self.region is not None and self._engine is not None:
            rc = self._engine.unregister_memory(self.region[0])
            if rc != 0:
                log.warning("mooncake: unregister_memory failed with code %d", rc)
        self._engine = None  # the engine stops when the last abandoned call drops its reference

    def _live(self) -> TransferEngine:
        if self._engine is None:
            raise TransferError("mooncake: backend already released")
        return self._engine


class _BoundedCalls:
    """Runs blocking library calls on daemon threads so the caller never waits past a deadline, and
    remembers the calls that outlived theirs."""

    def __init__(self) -> None:
        self._running: set[threading.Thread] = set()
        self._lock = threading.Lock()

    def call(self, fn: Callable[[], T], deadline: float, what: str) -> T:
        box: dict[str, object] = {}
        done = threading.Event()

        def run() -> None:
            try:
                box["result"] = fn()
            except BaseException as exc:  # handed to the caller below
                box["error"] = exc
            finally:
                with self._lock:
                    self._running.discard(thread)
                done.set()

        thread = threading.Thread(target=run, name="mooncake-call", daemon=True)
        with self._lock:
            self._running.add(thread)
        thread.start()
        if not done.wait(max(0.0, deadline - time.monotonic())):
            raise TransferError(f"{what} did not finish in time (TransferConfig.timeout_s); the library call "
                                f"keeps running until MC_TRANSFER_TIMEOUT", in_flight=True)
        if "error" in box:
            raise TransferError(f"{what} raised {box['error']!r}") from box["error"]  # type: ignore[misc]
        return box["result"]  # type: ignore[return-value]

    def wait_idle(self, timeout_s: float) -> int:
        """Wait up to ``timeout_s`` for abandoned calls; return how many are still running."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            threads = list(self._running)
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return sum(t.is_alive() for t in threads)
