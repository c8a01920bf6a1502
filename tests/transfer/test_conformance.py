"""One conformance suite for every transfer backend: the in-memory fake, Mooncake and NIXL for real.

The initiator runs in this process; for the real backends the target is a separate process
(multiprocessing spawn) on 127.0.0.1 that registers zeroed regions, hands over their descriptors and
answers "read" / "zero" over a pipe. Peer death is SIGKILL, a stalled peer is SIGSTOP. A real
backend whose library is not installed is skipped.

Memory: every region is host memory ("DRAM"), or, with ``EPD_TEST_DEVICE=cuda[:N]``
(tests/support/devices.py), memory of that GPU ("VRAM": torch tensors), so the same suite moves bytes
VRAM to VRAM on a GPU machine (scripts/gpu-check.sh); the in-memory fake (a memmove) and a Mooncake
build without CUDA then skip. The descriptor and the peer carry the memory kind and device id.
"""

from __future__ import annotations

import importlib.util
import multiprocessing as mp
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import msgspec
import numpy as np
import pytest

from tests.support.devices import DEVICE, on_gpu
from tests.support.process_stop import stop
from tests.support.transfer_fakes import FakeBackend
from transfer.base import (DESCRIPTOR_VERSION, Peer, RegionDescriptor, TransferBackend, TransferConfig, TransferError,
                           decode_descriptor)
from transfer.ops import WriteOp, block_ops

KINDS = ("fake", "mooncake", "nixl")
LIBRARIES = {"mooncake": "mooncake.engine", "nixl": "nixl"}
REGION = 4 << 20
BLOCK = 64 << 10  # 64 blocks per region
TIMEOUT_S = 1.5
SLACK_S = 1.5  # scheduling slack on a loaded 2-core machine
CONFIG = TransferConfig(timeout_s=TIMEOUT_S)
MEMORY = "VRAM" if on_gpu() else "DRAM"  # what every region of this suite is

pytestmark = pytest.mark.timeout(60)


def skip_unless_it_moves(kind: str) -> None:
    """Skip a backend that cannot move this suite's memory (or whose library is not installed)."""
    if kind != "fake":
        pytest.importorskip(LIBRARIES[kind])
    if MEMORY == "VRAM" and kind == "fake":
        pytest.skip("the fake's memmove cannot reach GPU memory")
    if MEMORY == "VRAM" and kind == "mooncake":
        from transfer.mooncake import cuda_build
        if not cuda_build():
            pytest.skip("this Mooncake build has no CUDA (extra mooncake-cuda)")


def make_backend(kind: str) -> TransferBackend:
    skip_unless_it_moves(kind)
    if kind == "fake":
        return FakeBackend(CONFIG)
    from transfer.registry import create_backend
    return create_backend(kind, CONFIG)


class Buffer:
    """``size`` bytes of MEMORY (zeros, or a copy of ``fill``): numpy on the host, a torch tensor on the GPU."""

    def __init__(self, size: int, fill: np.ndarray | None = None) -> None:
        self.size, self.device_id = size, 0
        if MEMORY == "VRAM":
            import torch

            self.tensor = torch.zeros(size, dtype=torch.uint8, device=DEVICE)
            if fill is not None:
                self.tensor.copy_(torch.from_numpy(fill))
            torch.cuda.synchronize(self.tensor.device)  # the bytes are there before a transfer engine reads them
            self.ptr, self.device_id = self.tensor.data_ptr(), self.tensor.device.index
        else:
            self.array = np.zeros(size, np.uint8) if fill is None else fill.copy()
            self.ptr = self.array.ctypes.data

    def register(self, backend: TransferBackend) -> None:
        backend.register(self.ptr, self.size, MEMORY, self.device_id)

    def read(self) -> np.ndarray:
        return self.tensor.cpu().numpy() if MEMORY == "VRAM" else self.array.copy()

    def zero(self) -> None:
        if MEMORY == "VRAM":
            self.tensor.zero_()
            self.tensor.cpu()  # waits for the kernel
        else:
            self.array[:] = 0


# ---------------------------------------------------------------------------------------------------
# Targets: a fake in this process, or a real backend in a spawned process


class LocalTarget:
    """``count`` fake targets in this process; kill() releases them, stall() stalls them."""

    def __init__(self, count: int) -> None:
        self.bufs = [Buffer(REGION) for _ in range(count)]
        self.backends = [FakeBackend(CONFIG) for _ in range(count)]
        for backend, buf in zip(self.backends, self.bufs):
            buf.register(backend)
        self.descriptors = [b.descriptor() for b in self.backends]

    def read(self) -> np.ndarray:
        return self.bufs[0].read()

    def zero(self) -> None:
        self.bufs[0].zero()

    def kill(self) -> None:
        self.close()

    def stall(self) -> None:
        for backend in self.backends:
            backend.stalled = True

    def close(self) -> None:
        for backend in self.backends:
            backend.release()


def _target_main(kind: str, conn, count: int) -> None:
    """A target process: ``count`` backends, each with a zeroed region; sends their descriptors,
    then serves read / zero (of the first region) and exit."""
    from transfer.registry import create_backend
    bufs = [Buffer(REGION) for _ in range(count)]
    backends = [create_backend(kind, CONFIG) for _ in range(count)]
    for backend, buf in zip(backends, bufs):
        buf.register(backend)
    conn.send([b.descriptor() for b in backends])
    while True:
        cmd = conn.recv()
        if cmd == "read":
            conn.send_bytes(bufs[0].read().tobytes())
        elif cmd == "zero":
            bufs[0].zero()
            conn.send("ok")
        elif cmd == "exit":
            for backend in backends:
                backend.release()
            conn.send("ok")
            return


class ProcessTarget:
    """``count`` targets of a real backend in one spawned process; kill() is SIGKILL, stall() SIGSTOP."""

    def __init__(self, kind: str, count: int) -> None:
        skip_unless_it_moves(kind)
        self.kind = kind
        self.conn, child = mp.get_context("spawn").Pipe()
        self.proc = mp.get_context("spawn").Process(target=_target_main, args=(kind, child, count), daemon=True)
        self.proc.start()
        self._descriptors: list[bytes] | None = None

    @property
    def descriptors(self) -> list[bytes]:
        """Waits for the process to come up (importing nixl imports torch: seconds)."""
        if self._descriptors is None:
            if not self.conn.poll(40):
                self.proc.kill()
                raise RuntimeError(f"{self.kind} target did not start (exit code {self.proc.exitcode})")
            self._descriptors = self.conn.recv()
        return self._descriptors

    def read(self) -> np.ndarray:
        assert self.descriptors
        self.conn.send("read")
        return np.frombuffer(self.conn.recv_bytes(), np.uint8)

    def zero(self) -> None:
        assert self.descriptors
        self.conn.send("zero")
        assert self.conn.recv() == "ok"

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(10)

    def stall(self) -> None:
        assert self.proc.pid is not None
        stop(self.proc.pid)  # returns once every thread has stopped

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send("exit")
                self.conn.poll(10) and self.conn.recv()
            except (OSError, EOFError):
                pass
        self.proc.kill()
        self.proc.join(10)


def start_target(kind: str, count: int = 1) -> LocalTarget | ProcessTarget:
    return LocalTarget(count) if kind == "fake" else ProcessTarget(kind, count)


@dataclass
class Initiator:
    backend: TransferBackend
    src: np.ndarray  # the bytes of its registered region (a host copy when that is GPU memory)


@pytest.fixture(scope="module", params=KINDS)
def kind(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def initiator(kind) -> Iterator[Initiator]:
    src = np.random.default_rng(0).integers(0, 256, REGION, dtype=np.uint8)
    backend = make_backend(kind)
    region = Buffer(REGION, fill=src)
    region.register(backend)
    yield Initiator(backend, src)
    backend.release()
    del region  # only now: the backend never frees it


@pytest.fixture(scope="module")
def spares(kind) -> Iterator[list[LocalTarget | ProcessTarget]]:
    """Targets for the two tests that kill or stall one, each holding a cold and a warm region.
    Started up front, so their processes come up while the other tests run."""
    targets = [start_target(kind, count=2) for _ in range(2)]
    yield targets
    for t in targets:
        t.close()


@pytest.fixture(scope="module")
def target(kind, spares, initiator):
    t = start_target(kind)
    yield t
    t.close()


@pytest.fixture
def doomed(kind, spares, initiator):
    """A target of its own (a cold and a warm region), for a test that kills or stalls it."""
    t = spares.pop() if spares else start_target(kind, count=2)
    yield t
    t.kill()
    t.close()


def expected_after(src: np.ndarray, ops: list[WriteOp]) -> np.ndarray:
    out = np.zeros(REGION, np.uint8)
    for op in ops:
        out[op.remote_offset:op.remote_offset + op.length] = src[op.local_offset:op.local_offset + op.length]
    return out


# ---------------------------------------------------------------------------------------------------
# The contract


def test_scattered_block_write_lands_exactly(initiator, target):
    target.zero()
    peer = initiator.backend.connect(target.descriptors[0])
    local, remote = [0, 1, 2, 7, 9, 10, 30, 63], [5, 6, 7, 20, 11, 12, 0, 40]
    ops = block_ops(local, remote, BLOCK)
    assert len(ops) == 5  # three runs merged, two single blocks
    ops.append(WriteOp(123, REGION - 1000, 1000))  # unaligned bytes, flush with the region's end
    moved = initiator.backend.write(peer, ops)
    assert moved == 8 * BLOCK + 1000
    got = target.read()
    assert np.array_equal(got, expected_after(initiator.src, ops))  # and every other byte still zero


def test_stats_count_bytes_and_time(initiator, target):
    peer = initiator.backend.connect(target.descriptors[0])
    before = initiator.backend.stats
    moved = initiator.backend.write(peer, [WriteOp(0, 0, 3 * BLOCK)])
    after = initiator.backend.stats
    assert (after.writes - before.writes, after.bytes - before.bytes) == (1, moved)
    assert after.seconds > before.seconds and after.failures == before.failures
    assert initiator.backend.write(peer, []) == 0


@pytest.mark.parametrize("bad, match", [
    (WriteOp(0, REGION - 10, 100), "remote region"),
    (WriteOp(REGION - 10, 0, 100), "local region"),
])
def test_out_of_range_op_raises_and_writes_nothing(initiator, target, bad, match):
    target.zero()
    peer = initiator.backend.connect(target.descriptors[0])
    with pytest.raises(TransferError, match=match):
        initiator.backend.write(peer, [WriteOp(0, 0, BLOCK), bad])
    assert not target.read().any()


def test_connect_is_cached_and_refuses_foreign_descriptors(kind, initiator, target):
    backend = initiator.backend
    assert backend.connect(target.descriptors[0]) is backend.connect(target.descriptors[0])
    others = [k for k in ("mooncake", "nixl") if k != kind and importlib.util.find_spec(k) is not None]
    if others:  # a real descriptor of another backend
        foreign = make_backend(others[0])
        buf = Buffer(4096)
        try:
            buf.register(foreign)
            with pytest.raises(TransferError, match=f"'{others[0]}' transfer backend but this process uses '{kind}'"):
                backend.connect(foreign.descriptor())
        finally:
            foreign.release()
    wrong_version = msgspec.msgpack.encode({"backend": kind, "version": DESCRIPTOR_VERSION + 1})
    for bad, match in [(b"\x00pool", "malformed"), (wrong_version, "version")]:
        with pytest.raises(TransferError, match=match):
            backend.connect(bad)
    with pytest.raises(TransferError, match="connect"):
        backend.write(Peer(kind, "stranger", 4096, REGION), [WriteOp(0, 0, 1)])


def test_concurrent_writes_from_threads(initiator, target):
    target.zero()
    peer = initiator.backend.connect(target.descriptors[0])
    batches = [block_ops(range(i, 64, 4), range(63 - i, -1, -4), BLOCK) for i in range(4)]
    errors: list[BaseException] = []

    def run(ops: list[WriteOp]) -> None:
        try:
            initiator.backend.write(peer, ops)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(ops,)) for ops in batches]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors
    assert np.array_equal(target.read(), expected_after(initiator.src, [op for ops in batches for op in ops]))


def test_register_once_and_release_is_idempotent(kind, target):
    backend = make_backend(kind)
    buf = Buffer(REGION)
    with pytest.raises(TransferError, match="before register"):
        backend.descriptor()
    buf.register(backend)
    with pytest.raises(TransferError, match="twice"):
        buf.register(backend)
    peer = backend.connect(target.descriptors[0])
    backend.release()
    backend.release()
    with pytest.raises(TransferError, match="released"):
        backend.write(peer, [WriteOp(0, 0, 1)])
    with pytest.raises(TransferError, match="released"):
        backend.connect(target.descriptors[0])


def _cold_and_warm(initiator: Initiator, doomed) -> list[Peer]:
    """Peers for the doomed target's two regions; the second has seen a write (connection up)."""
    cold, warm = (initiator.backend.connect(d) for d in doomed.descriptors)
    assert initiator.backend.write(warm, [WriteOp(0, 0, BLOCK)]) == BLOCK
    return [cold, warm]


def test_dead_peer_fails_within_timeout(initiator, doomed):
    peers = _cold_and_warm(initiator, doomed)
    doomed.kill()
    for peer in peers:
        failures = initiator.backend.stats.failures
        start = time.monotonic()
        with pytest.raises(TransferError):
            initiator.backend.write(peer, [WriteOp(0, 0, BLOCK), WriteOp(2 * BLOCK, 5 * BLOCK, BLOCK)])
        assert time.monotonic() - start < TIMEOUT_S + SLACK_S
        assert initiator.backend.stats.failures == failures + 1


def test_stalled_peer_never_blocks_past_timeout(initiator, doomed):
    """A stopped process: a write may still succeed (one-sided shared memory needs no help from the
    target), but it must return or raise TransferError within the timeout."""
    peers = _cold_and_warm(initiator, doomed)
    doomed.stall()
    for peer in peers:
        start = time.monotonic()
        try:
            assert initiator.backend.write(peer, [WriteOp(0, 0, 2 * BLOCK)]) == 2 * BLOCK
        except TransferError:
            pass
        assert time.monotonic() - start < TIMEOUT_S + SLACK_S


def test_a_stalled_peer_leaves_the_writes_to_others_alone(initiator, doomed, target):
    """Writes to a stopped peer, the first to one of its regions (Mooncake: the segment handshake)
    and one to a region written before, each of the whole region (past any socket buffer), fail or
    end at the timeout and hold nothing the writes to a live peer need: those land in time."""
    peers = _cold_and_warm(initiator, doomed)
    healthy = initiator.backend.connect(target.descriptors[0])
    assert initiator.backend.write(healthy, [WriteOp(0, 0, BLOCK)]) == BLOCK
    doomed.stall()
    for peer in peers:
        start = time.monotonic()
        try:
            initiator.backend.write(peer, [WriteOp(0, 0, REGION)])
        except TransferError:
            pass
        assert time.monotonic() - start < TIMEOUT_S + SLACK_S
    for i in range(1, 4):
        start = time.monotonic()
        assert initiator.backend.write(healthy, [WriteOp(i * BLOCK, 0, BLOCK)]) == BLOCK
        assert time.monotonic() - start < TIMEOUT_S + SLACK_S
        assert np.array_equal(target.read()[:BLOCK], initiator.src[i * BLOCK:(i + 1) * BLOCK])


def test_descriptor_and_peer_carry_the_memory_kind_and_device(kind, initiator, target):
    described = decode_descriptor(target.descriptors[0], kind, RegionDescriptor)
    expected_device = int(DEVICE.partition(":")[2] or 0) if MEMORY == "VRAM" else 0
    assert (described.memory, described.device_id) == (MEMORY, expected_device)
    peer = initiator.backend.connect(target.descriptors[0])
    assert (peer.memory, peer.device_id, peer.base, peer.length) == (MEMORY, expected_device, described.base, REGION)


def test_the_fake_describes_what_was_registered():
    """Any kind and device id travel as registered (the fake checks nothing about the memory itself)."""
    backend, other = FakeBackend(CONFIG), FakeBackend(CONFIG)
    buf = np.zeros(4096, np.uint8)
    try:
        backend.register(buf.ctypes.data, buf.size, "VRAM", 3)
        described = decode_descriptor(backend.descriptor(), "fake", RegionDescriptor)
        assert (described.memory, described.device_id) == ("VRAM", 3)
        other.register(buf.ctypes.data, buf.size)
        assert other.connect(backend.descriptor()).memory == "VRAM" and other.connect(backend.descriptor()).device_id == 3
    finally:
        backend.release()
        other.release()


@pytest.mark.parametrize("memory, device_id", [("HBM", 0), ("VRAM", -1)])
def test_register_refuses_an_unknown_memory_kind(memory, device_id):
    backend = FakeBackend(CONFIG)
    with pytest.raises(ValueError, match=r"memory must be one of \('DRAM', 'VRAM'\) and device_id >= 0"):
        backend.register(4096, 4096, memory, device_id)
    assert backend.region is None


def test_host_memory_registered_as_gpu_memory_is_refused(kind):
    """NIXL's UCX sees a host pointer where VRAM was promised; a Mooncake build without CUDA cannot
    move GPU memory at all, and says how to get the build that matches torch."""
    if kind == "fake":
        pytest.skip("the fake does not look at the memory")
    pytest.importorskip(LIBRARIES[kind])
    from transfer.registry import create_backend
    if kind == "mooncake":
        from transfer.mooncake import cuda_build
        if cuda_build():
            pytest.skip("a CUDA build of Mooncake takes the pointer's own location")
    backend = create_backend(kind, CONFIG)
    buf = np.zeros(4096, np.uint8)
    try:
        refusal = r"the installed build \(mooncake-transfer-engine-non-cuda\) cannot move GPU memory; rerun scripts/setup.sh"
        with pytest.raises(TransferError, match=refusal if kind == "mooncake" else "VRAM"):
            backend.register(buf.ctypes.data, buf.size, "VRAM", 0)
        assert backend.region is None
    finally:
        backend.release()
