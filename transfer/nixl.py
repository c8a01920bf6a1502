"""NIXL backend (``nixl``, UCX plugin, DRAM or VRAM descriptors).

Library facts this file relies on (1.5.1):
- It uses the bindings (``nixl._bindings``) rather than the ``nixl._api.nixl_agent`` wrapper: the
  wrapper hard-codes the progress thread's delay to 0, and that thread then busy-polls a whole core
  even when idle. Here it sleeps PROGRESS_DELAY_US between polls (2% of a core idle). Without a
  progress thread at all, transfers to a peer never complete (it must progress connection set-up).
- Errors are exceptions (``nixlNotFoundError`` for unknown peers or unregistered ranges,
  ``nixlRemoteDisconnectError`` for a dead peer, raised by ``postXferReq`` within milliseconds),
  not status codes; ``postXferReq``/``getXferStatus`` return SUCCESS or IN_PROG and never block.
- To a stalled peer a transfer stays IN_PROG forever; write() stops polling at its deadline and
  ``releaseXferReq`` cancels it. Writes carry no notification (nothing on the target reads them).
- The bundled UCX's InfiniBand modules pull in the system's libibverbs next to the wheel's own
  copy (when ``libibverbs1`` is installed, as Mooncake needs); the two libnl copies then crash the
  process at exit (SIGSEGV in ``rtnl_tc_unregister``, exit code 139 after a clean run). So
  protocol "tcp" (the default) sets ``UCX_MODULES=^ib`` unless the environment sets it: UCX without
  InfiniBand, i.e. shared memory, CMA and TCP. "rdma" and "ucx" leave UCX's full transport choice.
  UCX reads this once per process, at the first agent's backend creation.
- ``host`` is not advertised: the agent metadata in the descriptor carries UCX's own addresses. But
  UCX's TCP transport listens on every network interface's own address (not a wildcard, yet not only
  where it was told), and it cannot be given an address, only interfaces. So protocol "tcp" without
  a ``device`` pins UCX to the interface that holds ``host`` (``transfer/ucx_listen.py``:
  ``UCX_NET_DEVICES``, passed as the backend's ``engine_config``; a ``UCX_NET_DEVICES`` in the
  environment wins), and UCX then listens on that interface's address: ``host`` itself, or, on an
  interface with several addresses, its first one (127.0.0.1 for any 127.0.0.0/8 host). The bindings'
  ``ucx_devices`` is no substitute: it appends ":1" to each name, which matches InfiniBand ports,
  never a TCP interface (it is then ignored). ``device`` becomes ``ucx_devices``.
- GPU memory: the same wheels (``nixl-cu12`` / ``nixl-cu13``) register it as ``VRAM_SEG`` with the
  GPU's index as the descriptor's device id, on both sides of a transfer (each list names its own
  side's kind and device: the remote's come from its descriptor). UCX's CUDA transports take the
  GPU from the pointer; a write also makes its GPU current on the calling thread first
  (``cudaSetDevice``, via torch), so a copy never lands on device 0's context by default.
"""

from __future__ import annotations

import logging
import os
import time
import uuid

import msgspec
import nixl._bindings as nb  # nixl/__init__ picks the wheel flavour (nixl_cu12/cu13) and aliases it

from transfer.base import (DESCRIPTOR_VERSION, Peer, Region, RegionDescriptor, TransferBackend, TransferConfig,
                           TransferError, decode_descriptor)
from transfer.ops import WriteOp
from transfer.ucx_listen import ucx_params

log = logging.getLogger(__name__)
PROGRESS_DELAY_US = 100  # progress-thread sleep between polls
POLL_MIN_S, POLL_MAX_S = 20e-6, 1e-3  # write() polls the transfer state with this backoff
SEGMENTS = {"DRAM": nb.DRAM_SEG, "VRAM": nb.VRAM_SEG}


class NixlDescriptor(RegionDescriptor, frozen=True, kw_only=True):
    agent: str
    metadata: bytes  # the agent's UCX metadata (worker addresses, memory keys)


class NixlBackend(TransferBackend):
    """One NIXL agent per process (unique name), UCX backend, one registered region. A write is
    one transfer request with a descriptor pair per op, polled until done or the deadline.
    ``protocol``: "tcp" = UCX without InfiniBand; "rdma" / "ucx" = UCX's own choice."""

    name = "nixl"
    protocols = ("tcp", "rdma", "ucx")

    def __init__(self, config: TransferConfig) -> None:
        super().__init__(config)
        if config.protocol == "tcp":
            os.environ.setdefault("UCX_MODULES", "^ib")  # no InfiniBand: see the module docstring
        agent_config = nb.nixlAgentConfig()
        agent_config.useProgThread = True
        agent_config.pthrDelay = PROGRESS_DELAY_US
        agent_config.syncMode = nb.NIXL_THREAD_SYNC_RW  # concurrent transfers from several threads
        self.agent_name = f"epd-{uuid.uuid4().hex}"
        try:
            params = ucx_params(config)
        except ValueError as exc:
            raise TransferError(f"nixl: {exc}") from exc
        try:
            self._agent: nb.nixlAgent | None = nb.nixlAgent(self.agent_name, agent_config)
            self._ucx = self._agent.createBackend("UCX", params)
        except Exception as exc:
            raise TransferError(f"nixl: cannot start an agent with the UCX backend ({exc!r}); "
                                f"check TransferConfig.device") from exc
        self._reg: nb.nixlRegDList | None = None
        self._leaked: list[int] = []  # transfer handles whose release failed; retried at release()

    def _register(self, region: Region) -> None:
        reg = nb.nixlRegDList(SEGMENTS[region.memory], [(region.base, region.length, region.device_id, "")])
        try:
            self._live().registerMem(reg, [self._ucx])
        except Exception as exc:
            raise TransferError(f"nixl: registerMem({region.base:#x}, {region.length}) of {region.memory} "
                                f"(device {region.device_id}) failed: {exc!r}") from exc
        self._reg = reg

    def _descriptor(self) -> bytes:
        assert self.region is not None
        return msgspec.msgpack.encode(NixlDescriptor(
            backend=self.name, version=DESCRIPTOR_VERSION, **self.region._asdict(),
            agent=self.agent_name, metadata=self._live().getLocalMD()))

    def _connect(self, peer_descriptor: bytes) -> Peer:
        desc = decode_descriptor(peer_descriptor, self.name, NixlDescriptor)
        try:
            loaded = self._live().loadRemoteMD(desc.metadata).decode()
        except Exception as exc:
            raise TransferError(f"nixl: cannot load the metadata of agent {desc.agent}: {exc!r}") from exc
        if loaded != desc.agent:
            raise TransferError(f"nixl: descriptor names agent {desc.agent} but its metadata is {loaded}'s")
        return desc.peer(desc.agent)

    def _write(self, peer: Peer, ops: list[WriteOp], deadline: float) -> None:
        agent, region = self._live(), self.region
        assert region is not None
        if region.memory == "VRAM":
            _use_gpu(region.device_id)
        # (address, length, device id) tuples: cheaper to build than numpy arrays for the few ops a write has
        local = [(region.base + op.local_offset, op.length, region.device_id) for op in ops]
        remote = [(peer.base + op.remote_offset, op.length, peer.device_id) for op in ops]
        try:
            handle = agent.createXferReq(nb.NIXL_WRITE, nb.nixlXferDList(SEGMENTS[region.memory], local),
                                         nb.nixlXferDList(SEGMENTS[peer.memory], remote), peer.key, "", [self._ucx])
        except Exception as exc:
            raise TransferError(f"nixl: cannot create a transfer to {peer.key}: {exc!r}") from exc
        try:
            self._run(agent, handle, peer, deadline)
        except TransferError as exc:
            exc.in_flight = not self._release_handle(agent, handle)
            raise
        self._release_handle(agent, handle)

    def _run(self, agent: nb.nixlAgent, handle: int, peer: Peer, deadline: float) -> None:
        poll = POLL_MIN_S
        try:
            status = agent.postXferReq(handle, "")
            while status == nb.NIXL_IN_PROG:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransferError(f"nixl: write to {peer.key} not done within TransferConfig.timeout_s "
                                        f"({self.config.timeout_s}s); peer stalled?")
                time.sleep(min(poll, left))
                poll = min(poll * 2, POLL_MAX_S)
                status = agent.getXferStatus(handle)
        except TransferError:
            raise
        except Exception as exc:
            raise TransferError(f"nixl: write to {peer.key} failed: {exc!r}") from exc
        if status != nb.NIXL_SUCCESS:
            raise TransferError(f"nixl: write to {peer.key} ended with {status}")

    def _release_handle(self, agent: nb.nixlAgent, handle: int) -> bool:
        """Free a transfer handle, cancelling it if still running; False if NIXL could not."""
        try:
            agent.releaseXferReq(handle)
            return True
        except Exception as exc:
            log.warning("nixl: releaseXferReq failed (%r); retrying at release()", exc)
            self._leaked.append(handle)
            return False

    def _release(self) -> None:
        agent, self._agent = self._agent, None
        if agent is None:
            return
        for handle in self._leaked:
            try:
                agent.releaseXferReq(handle)
            except Exception as exc:
                log.warning("nixl: transfer handle still busy at release: %r", exc)
        for peer in self._peers.values():
            try:
                agent.invalidateRemoteMD(peer.key)
            except Exception as exc:
                log.warning("nixl: invalidateRemoteMD(%s) failed: %r", peer.key, exc)
        if self._reg is not None:
            try:
                agent.deregisterMem(self._reg, [self._ucx])
            except Exception as exc:
                log.warning("nixl: deregisterMem failed: %r", exc)
        # Dropping the last reference destroys the agent and joins its progress thread.

    def _live(self) -> nb.nixlAgent:
        if self._agent is None:
            raise TransferError("nixl: backend already released")
        return self._agent


def _use_gpu(device_id: int) -> None:
    """Make GPU ``device_id`` current on this thread (writes run on worker threads, whose current
    device would otherwise be 0). torch is there whenever VRAM is: the pool is a torch tensor."""
    import torch

    torch.cuda.set_device(device_id)

