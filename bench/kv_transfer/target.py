"""The target of the moves: a spawned process holding a zeroed pool registered with the backend (a
decode server's role), pinned before the library starts its threads; it answers the initiator's
questions over a pipe."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os

from bench.kv_transfer.layout import make_layout

START_S = 180.0
ANSWER_S = 120.0


def _target_main(backend_name: str, shape: dict, num_blocks: int, cores: list[int], timeout_s: float, conn) -> None:
    """The target: a zeroed pool registered with ``backend_name``; sends its descriptor, then answers
    ("digest", ids) with a hash of those blocks in that order, ("zero", ids) and "exit"."""
    if cores:
        os.sched_setaffinity(0, cores)  # before the library starts its threads: they inherit it
    import torch

    from stages.engine.kv_pool import KVPool
    from transfer.base import TransferConfig
    from transfer.registry import create_backend

    torch.set_num_threads(1)
    pool = KVPool(make_layout(shape, num_blocks))
    pool.tensor.zero_()  # fault every page in now, not during the first writes
    backend = create_backend(backend_name, TransferConfig(timeout_s=timeout_s))
    backend.register(pool.data_ptr, pool.nbytes)
    conn.send(backend.descriptor())
    while True:
        cmd, arg = conn.recv()
        if cmd == "digest":
            conn.send(hashlib.blake2b(pool.tensor[list(arg)].numpy().tobytes(), digest_size=16).hexdigest())
        elif cmd == "zero":
            pool.tensor[list(arg)] = 0
            conn.send("ok")
        elif cmd == "exit":
            backend.release()
            conn.send("ok")
            return


class Target:
    """The target process of one backend; ``ask`` sends it a command and waits for its answer."""

    def __init__(self, backend_name: str, shape: dict, num_blocks: int, cores: list[int], timeout_s: float) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_target_main, args=(backend_name, shape, num_blocks, cores, timeout_s, child),
                                daemon=True)
        self.proc.start()
        if not self.conn.poll(START_S):
            self.proc.kill()
            raise RuntimeError(f"{backend_name} target did not start (exit code {self.proc.exitcode})")
        self.descriptor: bytes = self.conn.recv()

    def ask(self, cmd: str, arg=None):
        self.conn.send((cmd, arg))
        if not self.conn.poll(ANSWER_S):
            raise RuntimeError(f"target did not answer {cmd!r}")
        return self.conn.recv()

    def close(self) -> None:
        try:
            if self.proc.is_alive():
                self.ask("exit")
        except (OSError, EOFError, RuntimeError):
            pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)
