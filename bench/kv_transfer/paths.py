"""The paths that move one cell's bytes (the same coalesced op list): ``ours`` (our backend's
``write``), ``raw`` (the library on the same engine/agent), ``raw_in_thread`` / ``raw_sync``
(Mooncake), ``raw_sleep_poll`` (NIXL) and ``memcpy`` (in-process ceiling); and the byte check."""

from __future__ import annotations

import hashlib
import time

PATHS = {"mooncake": ("ours", "raw", "raw_in_thread", "raw_sync", "memcpy"),
         "nixl": ("ours", "raw", "raw_sleep_poll", "memcpy")}


class Paths:
    """Callables moving one cell's ops for each path; built once per (size, layout), outside the timing."""

    def __init__(self, backend, peer, src, dst, local_ids: list[int], remote_ids: list[int], block_bytes: int) -> None:
        from transfer.ops import block_ops

        self.backend, self.peer = backend, peer
        self.local_ids, self.remote_ids, self.block_bytes = local_ids, remote_ids, block_bytes
        self.ops = block_ops(local_ids, remote_ids, block_bytes)
        base = backend.region[0]
        self.src_addrs = [base + op.local_offset for op in self.ops]
        self.dst_addrs = [peer.base + op.remote_offset for op in self.ops]
        self.lengths = [op.length for op in self.ops]
        self.bytes = sum(self.lengths)
        # memcpy: the same byte ranges between two tensors in this process (flat float32 views)
        item = src.element_size()
        flat_src, flat_dst = src.view(-1), dst.view(-1)
        self.copies = [(flat_dst[op.remote_offset // item:(op.remote_offset + op.length) // item],
                        flat_src[op.local_offset // item:(op.local_offset + op.length) // item]) for op in self.ops]
        if backend.name == "nixl":
            import numpy as np

            zeros = np.zeros(len(self.ops), dtype=np.uint64)
            self.local_descs = np.stack([np.array(self.src_addrs, np.uint64), np.array(self.lengths, np.uint64), zeros], 1)
            self.remote_descs = np.stack([np.array(self.dst_addrs, np.uint64), np.array(self.lengths, np.uint64), zeros], 1)

    def run(self, path: str) -> None:
        getattr(self, "_" + path)()

    def _ours(self) -> None:
        from transfer.ops import block_ops

        moved = self.backend.write(self.peer, block_ops(self.local_ids, self.remote_ids, self.block_bytes))
        assert moved == self.bytes

    def _memcpy(self) -> None:
        for dst, src in self.copies:
            dst.copy_(src)

    # Mooncake: the same engine our backend made, called on this thread
    def _raw(self) -> None:
        if self.backend.name == "mooncake":
            rc = self.backend._engine.batch_transfer_sync_write(self.peer.key, self.src_addrs, self.dst_addrs,
                                                                 self.lengths)
            if rc != 0:
                raise RuntimeError(f"batch_transfer_sync_write returned {rc}")
        else:
            self._nixl(sleep_poll=False)

    def _raw_in_thread(self) -> None:
        """The raw batch call run the way our backend runs it: on the backend's worker pool while the
        caller waits. raw_in_thread - raw = the thread hop; ours - raw_in_thread = the rest."""
        engine = self.backend._engine
        rc = self.backend._calls.call(lambda: engine.batch_transfer_sync_write(self.peer.key, self.src_addrs,
                                                                               self.dst_addrs, self.lengths),
                                      time.monotonic() + self.backend.config.timeout_s, "raw_in_thread")
        if rc != 0:
            raise RuntimeError(f"batch_transfer_sync_write returned {rc}")

    def _raw_sync(self) -> None:
        engine, key = self.backend._engine, self.peer.key
        for src, dst, n in zip(self.src_addrs, self.dst_addrs, self.lengths):
            rc = engine.transfer_sync_write(key, src, dst, n)
            if rc != 0:
                raise RuntimeError(f"transfer_sync_write returned {rc}")

    def _raw_sleep_poll(self) -> None:
        self._nixl(sleep_poll=True)

    # NIXL: the same agent and UCX backend our backend made
    def _nixl(self, sleep_poll: bool) -> None:
        import nixl._bindings as nb

        from transfer import nixl as ours

        agent, ucx = self.backend._agent, self.backend._ucx
        handle = agent.createXferReq(nb.NIXL_WRITE, nb.nixlXferDList(nb.DRAM_SEG, self.local_descs),
                                     nb.nixlXferDList(nb.DRAM_SEG, self.remote_descs), self.peer.key, "", [ucx])
        try:
            status = agent.postXferReq(handle, "")
            poll = ours.POLL_MIN_S
            while status == nb.NIXL_IN_PROG:
                if sleep_poll:  # our backend's schedule: sleep, doubling from POLL_MIN_S up to POLL_MAX_S
                    time.sleep(poll)
                    poll = min(poll * 2, ours.POLL_MAX_S)
                status = agent.getXferStatus(handle)
            if status != nb.NIXL_SUCCESS:
                raise RuntimeError(f"nixl transfer ended with {status}")
        finally:
            agent.releaseXferReq(handle)


def verify(paths: Paths, path: str, target, src, dst) -> bool:
    """Zero the destination, move once, compare bytes (the target hashes its blocks in remote-id order)."""
    import torch

    if path == "memcpy":
        for d, _ in paths.copies:
            d.zero_()
        paths.run(path)
        return all(torch.equal(d, s) for d, s in paths.copies)
    target.ask("zero", paths.remote_ids)
    paths.run(path)
    want = hashlib.blake2b(src[paths.local_ids].numpy().tobytes(), digest_size=16).hexdigest()
    return target.ask("digest", paths.remote_ids) == want
