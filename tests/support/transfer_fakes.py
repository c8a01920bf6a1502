"""An in-memory transfer backend for unit tests: every FakeBackend lives in this process, and a write
is a memmove into the target's registered region. It follows the TransferBackend contract (the
conformance suite runs it beside Mooncake and NIXL) and adds fault switches for tests of the logic
above it:

    target.stalled = True      writes to it wait until their deadline, then raise TransferError
    target.release()           it is gone: writes to it raise TransferError at once ("peer died")
    initiator.fail_writes = e  every write raises TransferError(e)
    initiator.writes           [(peer key, coalesced ops)] of every successful write, in order
"""

from __future__ import annotations

import ctypes
import threading
import time
import uuid

import msgspec

from transfer.base import (DESCRIPTOR_VERSION, Peer, Region, RegionDescriptor, TransferBackend, TransferConfig,
                           TransferError, decode_descriptor)
from transfer.ops import WriteOp

_LIVE: dict[str, FakeBackend] = {}  # registered, unreleased fakes by name
_LIVE_LOCK = threading.Lock()


class FakeDescriptor(RegionDescriptor, frozen=True, kw_only=True):
    fake: str


class FakeBackend(TransferBackend):
    name = "fake"
    protocols = ("tcp", "rdma", "ucx")

    def __init__(self, config: TransferConfig | None = None) -> None:
        super().__init__(config or TransferConfig())
        self.fake_name = f"fake-{uuid.uuid4().hex[:8]}"
        self.stalled = False
        self.fail_writes: str | None = None
        self.writes: list[tuple[str, list[WriteOp]]] = []

    def _register(self, region: Region) -> None:
        with _LIVE_LOCK:
            _LIVE[self.fake_name] = self

    def _descriptor(self) -> bytes:
        assert self.region is not None
        return msgspec.msgpack.encode(FakeDescriptor(backend=self.name, version=DESCRIPTOR_VERSION,
                                                     **self.region._asdict(), fake=self.fake_name))

    def _connect(self, peer_descriptor: bytes) -> Peer:
        desc = decode_descriptor(peer_descriptor, self.name, FakeDescriptor)
        return desc.peer(desc.fake)

    def _write(self, peer: Peer, ops: list[WriteOp], deadline: float) -> None:
        if self.fail_writes is not None:
            raise TransferError(f"fake: {self.fail_writes}")
        target = _LIVE.get(peer.key)
        if target is None:
            raise TransferError(f"fake: peer {peer.key} is gone")
        while target.stalled:
            if time.monotonic() >= deadline:
                raise TransferError(f"fake: peer {peer.key} stalled past TransferConfig.timeout_s")
            time.sleep(0.01)
        assert self.region is not None
        for op in ops:
            ctypes.memmove(peer.base + op.remote_offset, self.region.base + op.local_offset, op.length)
        self.writes.append((peer.key, ops))

    def _release(self) -> None:
        with _LIVE_LOCK:
            _LIVE.pop(self.fake_name, None)
