"""The two processes of a run, each in its rig host's network namespace: the sink (a decode's role:
a zeroed pool registered with the backend, and a TCP listener that writes what it receives into
that pool) and the source (a prefill's role: a random pool, our backend connected to the sink, the
raw library on the same engine, and a TCP connection to the sink's listener). The parent drives
them over a pipe (``Worker.ask``); a move is timed inside the source, around the move only."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import socket
import struct
import threading
import time

START_S = 180.0
ANSWER_S = 120.0
HEADER = struct.Struct("!I")  # op count; then OP per op
OP = struct.Struct("!QQ")  # remote offset, length
ACK = b"\x01"
LINK = "eth0"  # the rig's host end of the veth


# --- pure-ish helpers, shared by both sides --------------------------------------------------------
def link_tx_bytes(dev_text: str, interface: str = LINK) -> int:
    """Bytes sent by ``interface`` according to a ``/proc/net/dev`` text. Pure."""
    for line in dev_text.splitlines():
        name, sep, counters = line.partition(":")
        if sep and name.strip() == interface:
            return int(counters.split()[8])
    raise ValueError(f"no interface {interface!r} in /proc/net/dev")


def tcp_active_opens(snmp_text: str) -> int:
    """TCP connections opened from this namespace (``Tcp: ActiveOpens``) in a ``/proc/net/snmp`` text. Pure."""
    header, values = [line.split()[1:] for line in snmp_text.splitlines() if line.startswith("Tcp:")][:2]
    return int(values[header.index("ActiveOpens")])


def _link_now() -> tuple[int, int]:
    """(bytes the link has sent, TCP connections opened) in this process's network namespace (entered
    before any thread started)."""
    with open("/proc/self/net/dev") as dev, open("/proc/self/net/snmp") as snmp:
        return link_tx_bytes(dev.read()), tcp_active_opens(snmp.read())


def pieces(offset: int, length: int, chunk: int) -> list[tuple[int, int]]:
    """``[offset, offset + length)`` as (start, end) pieces of at most ``chunk`` bytes, in order. Pure."""
    return [(start, min(start + chunk, offset + length)) for start in range(offset, offset + length, chunk)]


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    while view:
        n = sock.recv_into(view)
        if n == 0:
            raise ConnectionError("the source closed the connection mid-move")
        view = view[n:]


def _serve_tcp(listener: socket.socket, pool_bytes: memoryview, chunk: int) -> None:
    """The sink's TCP receiver: per connection, moves until EOF: header, each op's bytes into the
    pool at its remote offset (``recv_into`` at most ``chunk`` bytes a call), then the ack."""
    while True:
        conn, _ = listener.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with conn:
            head = bytearray(HEADER.size)
            try:
                while True:
                    _recv_exact(conn, memoryview(head))
                    (count,) = HEADER.unpack(head)
                    ops = bytearray(OP.size * count)
                    _recv_exact(conn, memoryview(ops))
                    for offset, length in OP.iter_unpack(ops):
                        for start, end in pieces(offset, length, chunk):
                            _recv_exact(conn, pool_bytes[start:end])
                    conn.sendall(ACK)
            except ConnectionError:
                continue


class TcpSender:
    """The ``tcp`` path: the same ops' bytes from the source pool over one plain TCP connection,
    ``sendall`` of at most ``chunk`` bytes a call (the kernel moves 128 KiB calls faster than one
    call of many MiB on both sides: measured, 2.5 vs 1.9 GB/s here)."""

    def __init__(self, host: str, port: int, pool_bytes: memoryview, chunk: int) -> None:
        self.sock = socket.create_connection((host, port), timeout=ANSWER_S)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.pool_bytes, self.chunk = pool_bytes, chunk
        self.header, self.slices = b"", []

    def set_ops(self, ops) -> None:
        self.header = HEADER.pack(len(ops)) + b"".join(OP.pack(op.remote_offset, op.length) for op in ops)
        self.slices = [self.pool_bytes[start:end] for op in ops
                       for start, end in pieces(op.local_offset, op.length, self.chunk)]

    def move(self) -> None:
        self.sock.sendall(self.header)
        for piece in self.slices:
            self.sock.sendall(piece)
        ack = self.sock.recv(1)
        if ack != ACK:
            raise ConnectionError(f"the sink answered {ack!r} instead of the ack")


# --- the process -------------------------------------------------------------------------------
def _worker_main(role: str, netns: str, cores: list[int], backend_name: str, host: str, shape: dict,
                 num_blocks: int, timeout_s: float, seed: int, tcp_chunk: int, env: dict[str, str], conn) -> None:
    """Enter ``netns``, pin to ``cores``, set ``env`` (before any library reads it), build the pool and
    the backend (``host`` advertised), then
    answer the parent: the sink sends {pid, descriptor, tcp_port} first; both answer ("digest", ids)
    and ("zero", ids); the source answers ("connect", (descriptor, host, port)), ("cell", ids pair)
    -> {ops, bytes}, ("run", path) -> seconds, ("wire", path) -> {bytes, tcp_opens}: what its link sent and
    the TCP connections this namespace opened during one move;
    "exit" ends either."""
    from tests.support.server_forks import enter_netns

    enter_netns(netns)  # before any thread: the libraries' threads and every socket are the host's
    if cores:
        os.sched_setaffinity(0, cores)
    os.environ.update(env)
    import torch

    from bench.kv_transfer.layout import make_layout
    from stages.engine.kv_pool import KVPool
    from transfer.base import TransferConfig
    from transfer.registry import create_backend

    torch.set_num_threads(1)
    pool = KVPool(make_layout(shape, num_blocks))
    if role == "source":
        pool.tensor.copy_(torch.randn(pool.tensor.shape, generator=torch.Generator().manual_seed(seed)))
    else:
        pool.tensor.zero_()  # every page faulted in now, not during the first moves
    pool_bytes = memoryview(pool.tensor.view(-1).view(torch.uint8).numpy()).cast("B")
    backend = create_backend(backend_name, TransferConfig(host=host, timeout_s=timeout_s))
    backend.register(pool.data_ptr, pool.nbytes)
    if role == "sink":
        listener = socket.create_server((host, 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
        threading.Thread(target=_serve_tcp, args=(listener, pool_bytes, tcp_chunk), daemon=True,
                         name="tcp-sink").start()
        conn.send({"pid": os.getpid(), "descriptor": backend.descriptor(), "tcp_port": listener.getsockname()[1]})
    else:
        conn.send({"pid": os.getpid()})
    state: dict = {"tcp_chunk": tcp_chunk}
    try:
        while True:
            cmd, arg = conn.recv()
            if cmd == "exit":
                conn.send("ok")
                return
            try:
                conn.send(("ok", _answer(cmd, arg, pool, pool_bytes, backend, state)))
            except Exception as exc:  # noqa: BLE001 - the parent raises it, with this side's words
                conn.send(("error", f"{role} {cmd}: {exc!r}"))
    finally:
        backend.release()


def _answer(cmd: str, arg, pool, pool_bytes: memoryview, backend, state: dict):
    if cmd == "digest":
        return hashlib.blake2b(pool.tensor[list(arg)].numpy().tobytes(), digest_size=16).hexdigest()
    if cmd == "zero":
        pool.tensor[list(arg)] = 0
        return None
    if cmd == "connect":
        descriptor, host, port = arg
        state["peer"] = backend.connect(descriptor)
        state["tcp"] = TcpSender(host, port, pool_bytes, state["tcp_chunk"])
        return None
    if cmd == "cell":
        import torch

        from bench.kv_transfer.paths import Paths

        local_ids, remote_ids = arg
        # Paths' memcpy destination is never used here: an untouched empty tensor costs no pages
        paths = Paths(backend, state["peer"], pool.tensor, torch.empty_like(pool.tensor), list(local_ids),
                      list(remote_ids), pool.layout.block_bytes)
        state["paths"] = paths
        state["tcp"].set_ops(paths.ops)
        return {"ops": len(paths.ops), "bytes": paths.bytes}
    if cmd == "run":
        return _timed(state, arg)
    if cmd == "wire":
        (tx0, opens0) = _link_now()
        _timed(state, arg)
        tx1, opens1 = _link_now()
        return {"bytes": tx1 - tx0, "tcp_opens": opens1 - opens0}
    raise ValueError(f"unknown command {cmd!r}")


def _timed(state: dict, path: str) -> float:
    move = state["tcp"].move if path == "tcp" else (lambda: state["paths"].run(path))
    t0 = time.perf_counter()
    move()
    return time.perf_counter() - t0


class Worker:
    """A spawned worker (``_worker_main``, its environment plus ``env``); ``info`` is its first message,
    ``ask`` a command's answer."""

    def __init__(self, role: str, netns: str, cores: list[int], backend_name: str, host: str, shape: dict,
                 num_blocks: int, timeout_s: float, seed: int, tcp_chunk: int,
                 env: dict[str, str] | None = None) -> None:
        ctx = mp.get_context("spawn")
        self.role = role
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, name=f"kv_link-{role}", daemon=True,
                                args=(role, netns, cores, backend_name, host, shape, num_blocks, timeout_s, seed,
                                      tcp_chunk, env or {}, child))
        self.proc.start()
        child.close()
        if not self.conn.poll(START_S):
            self.proc.kill()
            raise RuntimeError(f"{backend_name} {role} did not start within {START_S:g} s "
                               f"(exit code {self.proc.exitcode})")
        self.info: dict = self.conn.recv()

    def ask(self, cmd: str, arg=None):
        """Send ``(cmd, arg)``; the answer, or RuntimeError with the worker's own words."""
        self.conn.send((cmd, arg))
        if not self.conn.poll(ANSWER_S):
            raise RuntimeError(f"{self.role} did not answer {cmd!r} within {ANSWER_S:g} s")
        status, value = self.conn.recv()
        if status != "ok":
            raise RuntimeError(value)
        return value

    def close(self) -> None:
        try:
            if self.proc.is_alive():
                self.conn.send(("exit", None))
                self.conn.poll(10)
        except (OSError, EOFError):
            pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)
