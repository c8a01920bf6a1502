"""Mooncake Transfer Engine backend (``mooncake-transfer-engine``, P2P handshake, TCP or RDMA).

Library facts this file relies on (0.3.13):
- Every call returns an int: 0 (or a positive port/id) is success, a negative value an error code
  (register twice: -7, unregister twice: -3, failed transfer: -1). Errors are also logged via glog.
- ``batch_transfer_sync_write`` releases the GIL and busy-polls until the batch completes, fails, or
  its own timeout passes (env ``MC_TRANSFER_TIMEOUT`` seconds, read when the engine is built, at
  least 5, default 30, plus 1 ns per byte). Before the first write to a target it opens the
  target's segment with a socket handshake that a stalled (not dead) peer holds for about 60 s.
  Neither can be cancelled, so each batch runs on one of WORKERS pooled worker threads and write()
  stops waiting at its deadline (TransferError with ``in_flight=True``); the call keeps its thread
  until it ends on its own (at once when the peer dies), and another thread takes its place, so a
  stalled peer does not stop the writes to the others. When MAX_ABANDONED threads are held by such
  calls, writes fail at once instead of piling up. A process that exits while such a call still runs
  aborts ("terminate called without an active exception"); release() waits up to ``timeout_s``.
- That first handshake runs under the binding's one mutex, which every write takes: a cold write to
  a stalled peer would hold up the writes to all the others for those 60 s. So a write to a peer
  that has not answered a probe since its last failed write first probes it with ``send_probe``
  (same daemon, no mutex, GIL released; transfer/mooncake_handshake.py), one probe per peer at a time.
- The TCP transport queues at most ~1024 transfers per peer and fails a batch beyond that, so writes
  go out in batches of MAX_BATCH ops. It also does not check that local buffers are registered.
- A dead peer fails a write within milliseconds (connection refused / reset).
- Listeners: ``initialize`` opens two, and binds both to every interface whatever ``host`` says (the
  library hard-codes INADDR_ANY / in6addr_any and has no option for it): the P2P handshake port
  (``rpc_port``, 0.0.0.0) and, with protocol "tcp", the TCP transport's data port ([::], dual-stack,
  so every IPv4 address too). Both ports are drawn at random from ``MC_MIN_RPC_PORT``..``MC_MAX_RPC_PORT``
  (default 15000-17000): the range to firewall (docs/architecture.md, "Listeners"). ``host`` is only
  what peers are told to dial.
- GPU memory: only a CUDA build (``mooncake-transfer-engine`` for CUDA 12, ``-cuda13`` for CUDA 13;
  ``transfer.builds``, which ``scripts/setup.sh`` reads to install the one matching torch) can register
  and move it: its ``register_memory`` finds the GPU from the pointer (location "*"), and its TCP
  transport stages device memory through host buffers itself. The host-only build
  (``mooncake-transfer-engine-non-cuda``, beside a CPU torch) would read a device pointer as host
  memory, so registering VRAM with it is refused, naming the fix.
"""

from __future__ import annotations

import logging
import math
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import msgspec
from mooncake.engine import TransferEngine

from process.addresses import host_port
from transfer.builds import installed_mooncake, mooncake_gpu_capable
from transfer.base import (DESCRIPTOR_VERSION, Peer, Region, RegionDescriptor, TransferBackend, TransferConfig,
                           TransferError, decode_descriptor)
from transfer.ops import WriteOp
from transfer.mooncake_handshake import Handshakes

log = logging.getLogger(__name__)
T = TypeVar("T")
MAX_BATCH = 512  # ops per batch_transfer_sync_write; the TCP transport's per-peer queue holds ~1024
WORKERS = 4  # library calls running at once per process; a write waits for a free one until its deadline
MAX_ABANDONED = 4 * WORKERS  # threads left to abandoned calls (stalled peers) beyond which writes fail at once


def cuda_build() -> bool:
    """Whether the installed Mooncake was built with CUDA (and so can register GPU memory)."""
    return mooncake_gpu_capable(installed_mooncake())


class MooncakeDescriptor(RegionDescriptor, frozen=True, kw_only=True):
    protocol: str
    host: str
    rpc_port: int

    @property
    def session_id(self) -> str:
        """Mooncake's name for the target: where its P2P handshake listens."""
        return host_port(self.host, self.rpc_port)


class MooncakeBackend(TransferBackend):
    """One ``TransferEngine`` per process with the P2P handshake (no metadata server). ``host`` is
    the address peers dial; Mooncake picks the RPC port. Writes are ``batch_transfer_sync_write``
    calls on a pool of WORKERS threads (started on first use), MAX_BATCH ops each, all under one
    deadline. ``threads_alive`` reports the pool's threads."""

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
        log.warning("mooncake: the transfer engine listens on every interface whatever --transfer-host says (the "
                    "library has no option): handshake port %d and its TCP data port, both in MC_MIN_RPC_PORT.."
                    "MC_MAX_RPC_PORT (default 15000-17000); firewall that range (docs/architecture.md, Listeners)",
                    self.rpc_port)
        self._calls = _WorkerPool()
        self._handshakes = Handshakes(lambda key: self._live().send_probe(key), self._calls.call)

    def _register(self, region: Region) -> None:
        if region.memory == "VRAM" and not cuda_build():
            raise TransferError(f"mooncake: the installed build ({', '.join(installed_mooncake()) or 'unknown'}) cannot "
                                "move GPU memory; rerun scripts/setup.sh (it installs the build that matches torch), "
                                "or use --transfer nixl, or --device cpu")
        rc = self._live().register_memory(region.base, region.length)
        if rc != 0:
            raise TransferError(f"mooncake: register_memory({region.base:#x}, {region.length}) of {region.memory} "
                                f"(device {region.device_id}) failed with code {rc}")

    def _descriptor(self) -> bytes:
        assert self.region is not None
        return msgspec.msgpack.encode(MooncakeDescriptor(
            backend=self.name, version=DESCRIPTOR_VERSION, **self.region._asdict(),
            protocol=self.config.protocol, host=self.config.host, rpc_port=self.rpc_port))

    def _connect(self, peer_descriptor: bytes) -> Peer:
        desc = decode_descriptor(peer_descriptor, self.name, MooncakeDescriptor)
        if desc.protocol != self.config.protocol:
            raise TransferError(f"mooncake: peer uses protocol {desc.protocol!r}, this process "
                                f"{self.config.protocol!r}; set the same TransferConfig.protocol on both sides")
        return desc.peer(desc.session_id)

    def _write(self, peer: Peer, ops: list[WriteOp], deadline: float) -> None:
        try:
            self._handshakes.ensure(peer.key, deadline)
            self._write_batches(peer, ops, deadline)
        except TransferError:
            self._handshakes.failed(peer.key)
            raise

    def _write_batches(self, peer: Peer, ops: list[WriteOp], deadline: float) -> None:
        engine = self._live()
        assert self.region is not None
        base = self.region.base
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

    def threads_alive(self) -> bool:
        return self._calls.alive()

    def _release(self) -> None:
        left = self._calls.wait_idle(self.config.timeout_s)
        if left:
            log.warning("mooncake: %d abandoned write(s) still running at release; the region must stay "
                        "allocated until they end (MC_TRANSFER_TIMEOUT)", left)
        self._calls.stop()
        if self.region is not None and self._engine is not None:
            rc = self._engine.unregister_memory(self.region.base)
            if rc != 0:
                log.warning("mooncake: unregister_memory failed with code %d", rc)
        self._engine = None  # the engine stops when the last abandoned call drops its reference

    def _live(self) -> TransferEngine:
        if self._engine is None:
            raise TransferError("mooncake: backend already released")
        return self._engine


@dataclass(eq=False)
class _Job(Generic[T]):
    fn: Callable[[], T] | None
    done: threading.Event = field(default_factory=threading.Event)
    result: T | None = None
    error: BaseException | None = None
    abandoned: bool = False  # the caller stopped waiting; set and read under the pool's lock


class _WorkerPool:
    """Daemon threads (started on demand, then reused) that run blocking library calls, at most
    ``size`` at once for callers still waiting, so that a caller never waits past its deadline.
    Contract of ``call`` (any thread):

    - it hands its call to a free worker, waiting until ``deadline`` while ``size`` calls run for
      waiting callers; nothing is queued without a worker to run it;
    - a call that outlives ``deadline`` is abandoned: the caller gets TransferError with
      ``in_flight=True`` at once, and the call keeps its thread until the library returns; it no
      longer counts against ``size`` (a peer that stalls holds threads, not the writes to others);
    - when ``max_abandoned`` threads are held by abandoned calls (the library is stuck on stalled
      peers), it fails at once with a TransferError saying so, until one of them returns.
    ``wait_idle`` and ``stop`` are for release; ``alive`` for health checks.
    """

    def __init__(self, size: int = WORKERS, max_abandoned: int = MAX_ABANDONED) -> None:
        if size < 1 or max_abandoned < 1:
            raise ValueError(f"a worker pool needs at least one worker and one abandoned slot, got {size}, "
                             f"{max_abandoned}")
        self.size = size
        self.max_abandoned = max_abandoned
        self._changed = threading.Condition()  # guards the fields below; notified when a call ends
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._busy = 0  # calls handed to a worker and not ended
        self._abandoned = 0  # of those, calls whose caller stopped waiting
        self._stopped = False

    def call(self, fn: Callable[[], T], deadline: float, what: str) -> T:
        job: _Job[T] = _Job(fn)
        self._hand_over(job, deadline, what)
        if not job.done.wait(max(0.0, deadline - time.monotonic())) and self._abandon(job):
            raise TransferError(f"{what} did not finish in time (TransferConfig.timeout_s); the library call "
                                f"keeps running until MC_TRANSFER_TIMEOUT", in_flight=True)
        if job.error is not None:
            raise TransferError(f"{what} raised {job.error!r}") from job.error
        return job.result  # type: ignore[return-value]  # set by fn() when error is None (T may itself be None)

    def alive(self) -> bool:
        """False once a started worker died (never expected: a worker catches whatever its call raises)."""
        with self._changed:
            return self._stopped or all(thread.is_alive() for thread in self._threads)

    def wait_idle(self, timeout_s: float) -> int:
        """Wait up to ``timeout_s`` for running calls (abandoned ones included); return how many still run."""
        with self._changed:
            self._changed.wait_for(lambda: self._busy == 0, timeout_s)
            return self._busy

    def stop(self) -> None:
        """Refuse new calls; each worker exits once its current call (if any) has returned."""
        with self._changed:
            self._stopped = True
            for _ in self._threads:
                self._jobs.put(None)

    def _hand_over(self, job: _Job, deadline: float, what: str) -> None:
        with self._changed:
            while True:
                if self._abandoned >= self.max_abandoned:
                    raise TransferError(f"{what}: {self._abandoned} mooncake worker threads are held by abandoned "
                                        f"calls (stalled peers); writes fail at once until one returns "
                                        f"(MC_TRANSFER_TIMEOUT)")
                if self._busy - self._abandoned < self.size:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransferError(f"{what}: no mooncake worker became free in time (TransferConfig."
                                        f"timeout_s); all {self.size} are running other writes")
                self._changed.wait(left)
            if self._stopped:
                raise TransferError("mooncake: backend already released")
            self._busy += 1
            if self._busy > len(self._threads):
                thread = threading.Thread(target=self._work, name=f"mooncake-worker-{len(self._threads)}",
                                          daemon=True)
                thread.start()
                self._threads.append(thread)
        self._jobs.put(job)

    def _abandon(self, job: _Job) -> bool:
        """Mark ``job`` abandoned unless it ended meanwhile; True if it was abandoned."""
        with self._changed:
            if job.done.is_set():
                return False
            job.abandoned = True
            self._abandoned += 1
            return True

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                assert job.fn is not None
                job.result = job.fn()
            except BaseException as exc:  # handed to the caller
                job.error = exc
            job.fn = None  # drop the library objects the call holds (release counts on it)
            with self._changed:
                self._busy -= 1
                self._abandoned -= job.abandoned
                job.done.set()
                self._changed.notify_all()
            job = None
