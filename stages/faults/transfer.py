"""The ``prefill.fail_kv_write`` fault point: ``FaultyBackend``, a transfer backend that wraps the real one."""

from __future__ import annotations

from stages.faults.points import Faults
from transfer.base import PROTOCOLS, Peer, Region, TransferBackend, TransferError
from transfer.ops import WriteOp


class FaultyBackend(TransferBackend):
    """``inner`` with the fault point ``prefill.fail_kv_write``: an armed write raises TransferError
    before anything moves (and is counted as a failed write). Everything else is ``inner``'s: this
    backend keeps the contract's bookkeeping (``transfer.base``) and hands each hook to the same call
    of ``inner``, which validates, caches and counts as it would alone. It takes ``inner``'s name, so
    descriptors and peers are the real backend's."""

    protocols = PROTOCOLS  # ``inner`` accepted the config's protocol

    def __init__(self, inner: TransferBackend, faults: Faults) -> None:
        self.name = inner.name
        super().__init__(inner.config)
        self.inner, self.faults = inner, faults

    def threads_alive(self) -> bool:
        return self.inner.threads_alive()

    def _register(self, region: Region) -> None:
        self.inner.register(*region)

    def _descriptor(self) -> bytes:
        return self.inner.descriptor()

    def _connect(self, peer_descriptor: bytes) -> Peer:
        return self.inner.connect(peer_descriptor)

    def _write(self, peer: Peer, ops: list[WriteOp], deadline: float) -> None:
        if self.faults.take("prefill.fail_kv_write"):
            raise TransferError("fault point prefill.fail_kv_write: the write was dropped, nothing was written")
        self.inner.write(peer, ops)

    def _release(self) -> None:
        self.inner.release()
