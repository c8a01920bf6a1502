"""The KV-transfer backend interface: one process writes byte ranges into another's registered memory.

Roles. The *target* (a decode server) owns the KV pool that gets written; the *initiator* (a prefill
server) writes into it. Every process plays both roles through one backend object:

    target:     register(pool_ptr, pool_bytes, memory, device_id)   once, at start
                descriptor() -> bytes            shipped to initiators (in the room handshake)
    initiator:  register(pool_ptr, pool_bytes, memory, device_id)   once, at start (the source of every write)
                connect(descriptor) -> Peer      per target, cached
                write(peer, ops) -> bytes moved  per request, blocking, any thread
    both:       release()                        once, at shutdown

Offsets in a ``WriteOp`` are relative to each side's registered region, so neither side ever sees
the other's raw pointers. A region is host memory (``"DRAM"``) or one GPU's memory (``"VRAM"`` with
that GPU's index as ``device_id``); the descriptor and the ``Peer`` carry both, so a backend can
address the remote side by its own kind (NIXL needs the remote GPU's id). Whether two kinds may be
paired is decided above this layer (the room handshake's fingerprint, ``transfer.fingerprint``). Block ids
become the fewest ops in ``transfer.ops`` (pure). The backends (``transfer/mooncake.py``, ``transfer/nixl.py``) only implement the underscored
hooks; validation, coalescing, caching, statistics and the release protocol live here, so every
backend (and the test fake) behaves the same at the edges.
"""

from __future__ import annotations

import ipaddress
import re
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, NamedTuple, TypeVar

import msgspec

from transfer.ops import WriteOp, coalesce

DESCRIPTOR_VERSION = 2  # 2: regions carry their memory kind and device id
PROTOCOLS = ("tcp", "rdma", "ucx")
MEMORY_KINDS = ("DRAM", "VRAM")  # host memory, GPU memory (NIXL's segment names)
_LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOSTNAME = re.compile(rf"^(?=.{{1,253}}$){_LABEL}(\.{_LABEL})*$")


@dataclass(frozen=True)
class TransferConfig:
    """Settings of one backend. ``host`` is the address peers use to reach this process (Mooncake
    advertises it; NIXL's UCX metadata carries its own addresses). ``protocol``: Mooncake "tcp" or
    "rdma"; NIXL "tcp" (UCX without InfiniBand), "rdma" or "ucx" (UCX's own choice). ``device``: RDMA
    device names (Mooncake's device filter, NIXL's ``ucx_devices``); empty = all. ``timeout_s``
    bounds every write."""

    host: str = "127.0.0.1"
    protocol: str = "tcp"
    device: str = ""
    timeout_s: float = 5.0  # --transfer-timeout-s: a decode that vanished mid-write costs a prefill this long

    def __post_init__(self) -> None:
        if not _is_host(self.host):
            raise ValueError(f"TransferConfig.host must be an IP address or a hostname, got {self.host!r}")
        if _is_unspecified(self.host):
            raise ValueError(f"transfer host {self.host!r} is a wildcard; give the address peers should dial "
                             "(--transfer-host)")
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"TransferConfig.protocol must be one of {PROTOCOLS}, got {self.protocol!r}")
        if not isinstance(self.device, str) or any(c.isspace() for c in self.device):
            raise ValueError(f"TransferConfig.device must be comma-separated device names, got {self.device!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"TransferConfig.timeout_s must be > 0, got {self.timeout_s}")


def _is_host(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return bool(_HOSTNAME.match(host))


def _is_unspecified(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False


def check_ops(ops: Sequence[WriteOp], local_length: int, remote_length: int) -> None:
    """Raise TransferError unless every op lies inside both regions."""
    for op in ops:
        if op.local_offset + op.length > local_length:
            raise TransferError(f"{op} reads past the local region ({local_length} bytes)")
        if op.remote_offset + op.length > remote_length:
            raise TransferError(f"{op} writes past the remote region ({remote_length} bytes)")


# ---------------------------------------------------------------------------------------------------
# Errors, peers, statistics, descriptors


class TransferError(RuntimeError):
    """A transfer could not be set up or did not complete. ``in_flight`` is True when the library call
    behind a failed write may still be running (it outlived the deadline and cannot be cancelled), so
    bytes may still land in the remote blocks until the library gives up on its own."""

    def __init__(self, message: str, *, in_flight: bool = False) -> None:
        super().__init__(message)
        self.in_flight = in_flight


class Region(NamedTuple):
    """A registered region: ``base`` pointer, ``length`` bytes, ``memory`` kind (``MEMORY_KINDS``) and
    ``device_id`` (the GPU's index for "VRAM"; 0 for "DRAM"). Its fields are a RegionDescriptor's."""

    base: int
    length: int
    memory: str = "DRAM"
    device_id: int = 0


@dataclass(frozen=True)
class Peer:
    """A connected target: ``key`` is the backend's name for it (Mooncake "host:rpc_port", NIXL agent
    name); ``base``/``length``/``memory``/``device_id`` describe its registered region."""

    backend: str
    key: str
    base: int
    length: int
    memory: str = "DRAM"
    device_id: int = 0


@dataclass(frozen=True)
class TransferStats:
    """Completed writes since start: count, bytes moved, seconds spent inside write(); failed writes."""

    writes: int = 0
    bytes: int = 0
    seconds: float = 0.0
    failures: int = 0

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


class DescriptorHeader(msgspec.Struct, frozen=True, kw_only=True):
    """The fields every backend's descriptor starts with; a backend's own Struct adds the rest."""

    backend: str
    version: int


class RegionDescriptor(DescriptorHeader, frozen=True, kw_only=True):
    """Header plus the registered region (``Region``'s fields)."""

    base: int
    length: int
    memory: str = "DRAM"
    device_id: int = 0

    def peer(self, key: str) -> Peer:
        """The Peer for this region, named ``key`` by its backend."""
        return Peer(self.backend, key, self.base, self.length, self.memory, self.device_id)


S = TypeVar("S", bound=RegionDescriptor)


def decode_descriptor(data: bytes, backend: str, kind: type[S]) -> S:
    """Decode a peer's descriptor (msgpack), refusing another backend's or another version's."""
    try:
        header = msgspec.msgpack.decode(data, type=DescriptorHeader)
    except (msgspec.DecodeError, TypeError) as exc:
        raise TransferError(f"{backend}: malformed peer descriptor ({exc})") from exc
    if header.backend != backend:
        raise TransferError(f"peer descriptor is from the {header.backend!r} transfer backend but this process "
                            f"uses {backend!r}; start both servers with the same --transfer")
    if header.version != DESCRIPTOR_VERSION:
        raise TransferError(f"{backend}: peer descriptor version {header.version}, this process speaks "
                            f"{DESCRIPTOR_VERSION}; run the same epd-stage version on both servers")
    try:
        desc = msgspec.msgpack.decode(data, type=kind)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise TransferError(f"{backend}: malformed peer descriptor ({exc})") from exc
    if desc.base <= 0 or desc.length <= 0:
        raise TransferError(f"{backend}: peer descriptor has no registered region")
    if desc.memory not in MEMORY_KINDS or desc.device_id < 0:
        raise TransferError(f"{backend}: peer descriptor names memory {desc.memory!r} on device {desc.device_id}; "
                            f"expected one of {MEMORY_KINDS} and a device id >= 0")
    return desc


# ---------------------------------------------------------------------------------------------------
# The backend


class TransferBackend(ABC):
    """One process's endpoint. Subclasses set ``name`` (the registry name: a class attribute; a
    backend that wraps another sets the inner one's per instance), ``protocols`` (accepted
    ``TransferConfig.protocol`` values) and implement the ``_`` hooks; the public methods below hold
    the contract and call the hooks at most as documented."""

    name: str
    protocols: ClassVar[tuple[str, ...]]

    def __init__(self, config: TransferConfig) -> None:
        """Start the library (engine, agent, listener threads). Called once per process at server
        start, from any thread. Raises TransferError if the library cannot start."""
        if config.protocol not in self.protocols:
            raise ValueError(f"TransferConfig.protocol {config.protocol!r} is not supported by the {self.name} "
                             f"backend; use one of {self.protocols}")
        self.config = config
        self.region: Region | None = None  # once registered
        self._lock = threading.Lock()  # region, peers, released, in-flight count, stats
        self._idle = threading.Condition(self._lock)
        self._peers: dict[bytes, Peer] = {}
        self._in_flight = 0
        self._released = False
        self._stats = TransferStats()

    def register(self, ptr: int, length: int, memory: str = "DRAM", device_id: int = 0) -> None:
        """Register ``length`` bytes at ``ptr`` (the whole KV pool) for transfers in both directions:
        host memory (``memory="DRAM"``) or the memory of GPU ``device_id`` (``"VRAM"``).

        Called once per process, before descriptor() and write(); a second call raises TransferError,
        and so does a memory kind this backend (or its installed build) cannot move, naming the fix.
        The caller keeps the memory allocated until release() has returned; the backend never frees it.
        For VRAM, the caller also makes sure the bytes are written before each write() (a device sync).
        """
        if ptr <= 0 or length <= 0:
            raise ValueError(f"register: need a pointer and a length > 0, got ptr={ptr} length={length}")
        if memory not in MEMORY_KINDS or device_id < 0:
            raise ValueError(f"register: memory must be one of {MEMORY_KINDS} and device_id >= 0, "
                             f"got {memory!r}, {device_id}")
        region = Region(ptr, length, memory, device_id)
        with self._lock:
            self._check_open()
            if self.region is not None:
                raise TransferError(f"{self.name}: register() called twice; a process registers its KV pool once")
            self._register(region)
            self.region = region

    def descriptor(self) -> bytes:
        """Everything a peer needs to write into this process's region: msgpack bytes naming the backend.

        Called by the target after register(), as often as wanted (the bytes do not change); thread-safe.
        """
        with self._lock:
            self._check_open()
            if self.region is None:
                raise TransferError(f"{self.name}: descriptor() before register()")
            return self._descriptor()

    def connect(self, peer_descriptor: bytes) -> Peer:
        """Validate a target's descriptor and make it reachable; returns the same Peer for the same bytes.

        Called by the initiator once per request (cheap after the first call for a target); thread-safe.
        Raises TransferError for a descriptor of another backend or version, or a malformed one.
        """
        with self._lock:
            self._check_open()
            peer = self._peers.get(peer_descriptor)
            if peer is None:
                peer = self._connect(peer_descriptor)
                self._peers[peer_descriptor] = peer
            return peer

    def write(self, peer: Peer, ops: Sequence[WriteOp]) -> int:
        """Copy every op from this process's region into ``peer``'s region; returns the bytes moved.

        Blocking; called by the initiator from any thread, concurrently. Coalesces the ops, checks that
        every op lies inside both regions (TransferError, and nothing is written, if one does not), then
        moves all of them as one batch. Raises TransferError on any failure, and within
        ``config.timeout_s`` (plus scheduling slack) when the peer is dead or stalled. After a failure
        the remote blocks hold unspecified bytes. Once write() has returned or raised, nothing more
        lands in them, unless the TransferError says ``in_flight`` (a library call that could not be
        cancelled outlived the deadline; Mooncake only): then bytes may land until that call ends.
        """
        ops = coalesce(ops)
        with self._lock:
            self._check_open()
            if self.region is None:
                raise TransferError(f"{self.name}: write() before register()")
            if peer.backend != self.name or peer not in self._peers.values():
                raise TransferError(f"{self.name}: {peer} did not come from this backend's connect()")
            check_ops(ops, self.region.length, peer.length)
            self._in_flight += 1
        start = time.monotonic()
        try:
            if ops:
                self._write(peer, ops, start + self.config.timeout_s)
        except BaseException:
            self._finish(0, 0.0, failed=True)
            raise
        moved = sum(op.length for op in ops)
        self._finish(moved, time.monotonic() - start, failed=False)
        return moved

    def release(self) -> None:
        """Deregister the region, forget the peers and stop the library. Idempotent, thread-safe.

        Called once at shutdown. Waits up to ``config.timeout_s`` for writes in progress; writes started
        afterwards raise TransferError. The caller may free the region once this returns (unless a
        backend logged abandoned library calls still running: then keep it until the process exits).
        """
        with self._lock:
            if self._released:
                return
            self._released = True
            self._idle.wait_for(lambda: self._in_flight == 0, timeout=self.config.timeout_s)
            self._release()
            self._peers.clear()
            self.region = None

    def threads_alive(self) -> bool:
        """False once a worker thread this backend started has died; the owner's health check asks
        (thread-safe, cheap). Threads inside a library are not observable and not counted: NIXL's
        progress thread is started and run by the NIXL agent itself, so NIXL keeps this default."""
        return True

    @property
    def stats(self) -> TransferStats:
        """A snapshot of the counters; thread-safe."""
        with self._lock:
            return self._stats

    def __enter__(self) -> TransferBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def _check_open(self) -> None:
        if self._released:
            raise TransferError(f"{self.name}: backend already released")

    def _finish(self, moved: int, seconds: float, *, failed: bool) -> None:
        with self._lock:
            s = self._stats
            self._stats = TransferStats(s.writes + (not failed), s.bytes + moved, s.seconds + seconds,
                                        s.failures + failed)
            self._in_flight -= 1
            self._idle.notify_all()

    # Hooks. All but _write run under self._lock (serialized); _write runs concurrently.

    @abstractmethod
    def _register(self, region: Region) -> None:
        """Register the region with the library; raise TransferError on failure (naming the fix when
        the library cannot move that memory kind)."""

    @abstractmethod
    def _descriptor(self) -> bytes:
        """Encode this process's descriptor, a RegionDescriptor subclass (``**self.region._asdict()``
        fills the region's fields), with msgspec msgpack."""

    @abstractmethod
    def _connect(self, peer_descriptor: bytes) -> Peer:
        """Decode and validate a descriptor (use decode_descriptor) and return its Peer (``desc.peer``)."""

    @abstractmethod
    def _write(self, peer: Peer, ops: list[WriteOp], deadline: float) -> None:
        """Move the already validated, coalesced, non-empty ops; return by ``deadline`` (monotonic)
        or raise TransferError. Must be safe to call from several threads at once."""

    @abstractmethod
    def _release(self) -> None:
        """Deregister the region and stop the library; must not raise."""
