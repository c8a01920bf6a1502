"""KV move time and bandwidth of our transfer layer vs the raw library vs an in-process memcpy.

    python bench/kv_transfer.py                 # full run (~2-3 minutes on 2 cores)
    python bench/kv_transfer.py --quick         # smoke run (~1 minute)
    python bench/kv_transfer.py --backends nixl --tokens 512,2048 --reps 60

What moves: the KV of a 512 / 2048 / 8192-token prompt on the ``small`` model's KV layout (built
from its ``config.json`` without loading weights: block-major ``[blocks, layers, 2, 16, kv_heads,
head_dim]``, float32, ``KVLayout.block_bytes`` per block), from a pool in this process (the
initiator, a prefill server's role) into a pool in a spawned target process (a decode server's
role), over loopback, for each backend (mooncake, nixl). Two remote block layouts:

- contiguous: remote block ids are one run, so ``block_ops`` coalesces the prompt into one op;
- fragmented: remote block ids are a random sample of the target pool (checked: one op per block),
  as in a decode pool that has served many requests.

Paths, all moving the same byte ranges (the coalesced op list), interleaved in a random order
within each repetition so that drift in the machine's load hits them alike:

- ``ours``: ``block_ops(local ids, remote ids, block_bytes)`` + ``backend.write(peer, ops)``, i.e.
  what the prefill server does per request (coalescing, validation, locking, statistics, and the
  backend's own call path: Mooncake's worker thread, NIXL's descriptor building and sleep/backoff poll);
- ``raw``: the library called directly on the *same* engine / agent (same registered memory, same
  connection), with the address lists computed beforehand: Mooncake ``batch_transfer_sync_write``
  with the op list (the call our backend makes, on the calling thread); NIXL ``createXferReq`` +
  ``postXferReq`` + busy-poll ``getXferStatus`` + ``releaseXferReq`` (what the ``nixl_agent``
  wrapper's ``initialize_xfer`` / ``transfer`` / ``check_xfer_state`` call; the wrapper itself is
  not used because its agent's progress thread busy-polls a whole core);
- ``raw_in_thread`` (Mooncake only): the same raw batch call, run on a fresh worker thread while the
  caller waits, as our backend does (to bound a call that cannot be cancelled): separates the
  thread hop from the rest of our layer;
- ``raw_sync`` (Mooncake only): ``transfer_sync_write`` once per op (one call per contiguous run);
- ``raw_sleep_poll`` (NIXL only): the raw calls, polled with our backend's sleep/backoff schedule
  (on loopback ``postXferReq`` completes the copy itself, so this is the same work as ``raw``: the
  gap between the two is the measurement noise);
- ``memcpy``: ``torch`` ``copy_`` of the same ops between two CPU tensors in this process (one
  torch thread): the ceiling for any loopback move.

Each cell is measured ``--reps`` times (4x for the 4 MiB cells, 2/3 for 64 MiB) after warm-up
writes; the table gives median, p90 and min time,
GB/s at the median (1 GB = 1e9 B) and the ratios ours/raw (goal >= 0.9) and each/memcpy. Every
path's bytes are checked once (the target hashes its blocks). A breakdown times our layer's parts
in isolation (block_ops, coalesce + check_ops, the worker-thread hop, descriptor building).

Pinning: this process (initiator + memcpy) on ``--initiator-cores`` (core 0), the target on
``--target-cores`` (core 1); the libraries' threads inherit their process's core. Recorded with
the 1-minute load average, the machine-wide CPU busy fraction and each process's CPU seconds.

Output: a table on stdout, ``bench/results/kv_transfer.json`` and ``kv_transfer.png``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(REPO))

from bench.common import (  # noqa: E402
    CpuMeter,
    add_model_args,
    add_output_args,
    loadavg,
    machine_info,
    make_parser,
    output_path,
    parse_cores,
    percentile,
    pin_this_process,
    pyplot,
    resolve_model,
    save_figure,
    write_json,
)

from transfer.registry import BACKENDS  # noqa: E402
GOAL_RATIO = 0.9  # ours / raw, bandwidth at the median
POOL_HEADROOM = 2  # pools hold this many times the largest prompt's blocks (room to fragment)
PATHS = {"mooncake": ("ours", "raw", "raw_in_thread", "raw_sync", "memcpy"),
         "nixl": ("ours", "raw", "raw_sleep_poll", "memcpy")}


# --- layout ----------------------------------------------------------------------------------
def layout_shape(model_dir: Path, block_size: int) -> dict:
    """KVLayout keyword arguments (all but num_blocks) from the checkpoint's text config, as the engine does."""
    config = json.loads((model_dir / "config.json").read_text())
    text = config.get("text_config") or config
    head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    return {"num_layers": text["num_hidden_layers"], "block_size": block_size,
            "num_kv_heads": text["num_key_value_heads"], "head_dim": head_dim}


def make_layout(shape: dict, num_blocks: int):
    import torch

    from stages.engine.kv_pool import KVLayout

    return KVLayout(num_blocks=num_blocks, dtype=torch.float32, **shape)


# --- target process --------------------------------------------------------------------------
def _target_main(backend_name: str, shape: dict, num_blocks: int, cores: list[int], timeout_s: float, conn) -> None:
    """The target: a zeroed pool registered with ``backend_name``; sends its descriptor, then answers
    ("digest", ids) with a hash of those blocks in that order, ("zero", ids), "cpu" and "exit"."""
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
        elif cmd == "cpu":
            usage = resource.getrusage(resource.RUSAGE_SELF)
            conn.send(usage.ru_utime + usage.ru_stime)
        elif cmd == "exit":
            backend.release()
            conn.send("ok")
            return


class Target:
    def __init__(self, backend_name: str, shape: dict, num_blocks: int, cores: list[int], timeout_s: float) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_target_main, args=(backend_name, shape, num_blocks, cores, timeout_s, child),
                                daemon=True)
        self.proc.start()
        if not self.conn.poll(180):
            self.proc.kill()
            raise RuntimeError(f"{backend_name} target did not start (exit code {self.proc.exitcode})")
        self.descriptor: bytes = self.conn.recv()

    def ask(self, cmd: str, arg=None):
        self.conn.send((cmd, arg))
        if not self.conn.poll(120):
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


# --- the paths -------------------------------------------------------------------------------
class Paths:
    """Callables moving one cell's ops for each path; built once per (size, layout), outside the timing."""

    def __init__(self, backend, peer, src, dst, local_ids: list[int], remote_ids: list[int], block_bytes: int) -> None:
        from transfer.base import block_ops

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
        from transfer.base import block_ops

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


# --- measurement -----------------------------------------------------------------------------
def reps_for(reps: int, nbytes: int) -> int:
    """More repetitions for the small cells (cheap, and the most disturbed by scheduling), fewer for 64 MiB."""
    if nbytes <= (4 << 20):
        return 4 * reps
    return reps if nbytes < (32 << 20) else max(3, reps * 2 // 3)


def summarize(times_s: list[float], nbytes: int) -> dict:
    median = statistics.median(times_s)
    return {"n": len(times_s), "median_ms": round(1e3 * median, 4), "p90_ms": round(1e3 * percentile(times_s, 0.9), 4),
            "min_ms": round(1e3 * min(times_s), 4), "gbps": round(nbytes / median / 1e9, 3),
            "gbps_p90_time": round(nbytes / percentile(times_s, 0.9) / 1e9, 3)}


def micro(fn, iters: int) -> float:
    """Median seconds of ``fn()`` over ``iters`` calls."""
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def breakdown(paths: Paths, iters: int) -> dict:
    """Our layer's parts, timed in isolation on this cell's ids and ops (median microseconds)."""
    from transfer.base import block_ops, check_ops, coalesce

    backend, peer = paths.backend, paths.peer
    out = {
        "block_ops_us": micro(lambda: block_ops(paths.local_ids, paths.remote_ids, paths.block_bytes), iters),
        "coalesce_and_check_us": micro(lambda: check_ops(coalesce(paths.ops), backend.region[1], peer.length), iters),
    }
    if backend.name == "mooncake":
        calls = backend._calls
        base = backend.region[0]
        out["address_lists_us"] = micro(lambda: ([base + op.local_offset for op in paths.ops],
                                                 [peer.base + op.remote_offset for op in paths.ops],
                                                 [op.length for op in paths.ops]), iters)
        out["worker_thread_hop_us"] = micro(lambda: calls.call(lambda: 0, time.monotonic() + 10, "noop"), iters)
    else:
        import nixl._bindings as nb
        import numpy as np

        base = backend.region[0]

        def descs():
            table = np.array([(op.local_offset, op.remote_offset, op.length) for op in paths.ops], dtype=np.uint64)
            zeros = np.zeros(len(paths.ops), dtype=np.uint64)
            local = np.stack([table[:, 0] + np.uint64(base), table[:, 2], zeros], axis=1)
            remote = np.stack([table[:, 1] + np.uint64(peer.base), table[:, 2], zeros], axis=1)
            return nb.nixlXferDList(nb.DRAM_SEG, local), nb.nixlXferDList(nb.DRAM_SEG, remote)

        out["descriptor_build_us"] = micro(descs, iters)
        out["raw_prebuilt_arrays_dlist_us"] = micro(lambda: (nb.nixlXferDList(nb.DRAM_SEG, paths.local_descs),
                                                             nb.nixlXferDList(nb.DRAM_SEG, paths.remote_descs)), iters)
        # what a sleep in the poll loop really costs on this (possibly busy) core
        out["sleep_20us_actual_us"] = micro(lambda: time.sleep(20e-6), max(10, iters // 4))
        out["sleep_1ms_actual_us"] = micro(lambda: time.sleep(1e-3), max(10, iters // 10))
    result = {k: round(v * 1e6, 1) for k, v in out.items()}
    if backend.name == "nixl":
        result["raw_phases"] = nixl_phases(paths, max(5, iters // 20))
    return result


def nixl_phases(paths: Paths, iters: int) -> dict:
    """The raw NIXL write split into its calls (median us): descriptor lists + createXferReq, postXferReq,
    the busy poll until done (and how many getXferStatus calls), releaseXferReq."""
    import nixl._bindings as nb

    agent, ucx = paths.backend._agent, paths.backend._ucx
    rows = []
    for _ in range(iters):
        t0 = time.perf_counter()
        handle = agent.createXferReq(nb.NIXL_WRITE, nb.nixlXferDList(nb.DRAM_SEG, paths.local_descs),
                                     nb.nixlXferDList(nb.DRAM_SEG, paths.remote_descs), paths.peer.key, "", [ucx])
        t1 = time.perf_counter()
        status = agent.postXferReq(handle, "")
        t2 = time.perf_counter()
        done_at_post = status == nb.NIXL_SUCCESS
        polls = 0
        while status == nb.NIXL_IN_PROG:
            status = agent.getXferStatus(handle)
            polls += 1
        t3 = time.perf_counter()
        agent.releaseXferReq(handle)
        t4 = time.perf_counter()
        rows.append((t1 - t0, t2 - t1, t3 - t2, t4 - t3, polls, done_at_post))
    def med(i: int) -> float:
        return round(1e6 * statistics.median(r[i] for r in rows), 1)

    return {"create_us": med(0), "post_us": med(1), "poll_until_done_us": med(2), "release_us": med(3),
            "polls": int(statistics.median(r[4] for r in rows)), "done_at_post": sum(r[5] for r in rows),
            "iters": iters}


def verify(paths: Paths, path: str, target: Target, src, dst) -> bool:
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


def fragmented_ids(n: int, pool_blocks: int, rng: random.Random, block_bytes: int) -> list[int]:
    """Remote ids drawn at random from the pool, none continuing its predecessor (one op per block)."""
    from transfer.base import block_ops

    for _ in range(100):
        ids = rng.sample(range(pool_blocks), n)
        if len(block_ops(list(range(n)), ids, block_bytes)) == n:
            return ids
        for i in range(1, n):  # repair adjacent pairs by swapping with a random later position
            if ids[i] == ids[i - 1] + 1:
                j = rng.randrange(n)
                ids[i], ids[j] = ids[j], ids[i]
        if len(block_ops(list(range(n)), ids, block_bytes)) == n:
            return ids
    raise RuntimeError("could not draw a fully fragmented block list")


def run_backend(name: str, args, shape: dict, pool_blocks: int, src, dst, target_cores: list[int]) -> dict:
    from transfer.base import TransferConfig
    from transfer.registry import create_backend

    layout = make_layout(shape, pool_blocks)
    started = time.perf_counter()
    target = Target(name, shape, pool_blocks, target_cores, args.timeout)
    backend = create_backend(name, TransferConfig(timeout_s=args.timeout))
    rng = random.Random(args.seed)
    cells = []
    try:
        backend.register(src.data_ptr(), src.numel() * src.element_size())
        peer = backend.connect(target.descriptor)
        startup_s = time.perf_counter() - started
        print(f"[{name}] target pid {target.proc.pid} on cores {target_cores or 'any'}, up in {startup_s:.1f} s",
              flush=True)
        meter = CpuMeter({os.getpid(), target.proc.pid}, cpu_key="initiator_cpu_s")
        target_cpu0 = target.ask("cpu")
        for tokens in args.tokens:
            n = -(-tokens // shape["block_size"])
            local_ids = list(range(n))
            for layout_name in ("contiguous", "fragmented"):
                if layout_name == "contiguous":
                    first = pool_blocks - n - 3  # a run that does not start at 0 (offsets on both sides differ)
                    remote_ids = list(range(first, first + n))
                else:
                    remote_ids = fragmented_ids(n, pool_blocks, rng, layout.block_bytes)
                paths = Paths(backend, peer, src, dst, local_ids, remote_ids, layout.block_bytes)
                names = PATHS[name]
                checked = {p: verify(paths, p, target, src, dst) for p in names}
                if not all(checked.values()):
                    raise RuntimeError(f"{name} {tokens} tokens {layout_name}: wrong bytes after {checked}")
                for _ in range(args.warmup):
                    for p in names:
                        paths.run(p)
                times: dict[str, list[float]] = {p: [] for p in names}
                reps = reps_for(args.reps, paths.bytes)
                order = list(names)
                for _ in range(reps):
                    rng.shuffle(order)
                    for p in order:
                        t0 = time.perf_counter()
                        paths.run(p)
                        times[p].append(time.perf_counter() - t0)
                cell = {"tokens": tokens, "layout": layout_name, "blocks": n, "ops": len(paths.ops),
                        "bytes": paths.bytes, "verified": True,
                        "paths": {p: summarize(times[p], paths.bytes) for p in names},
                        "breakdown": breakdown(paths, args.micro_iters)}
                res = cell["paths"]
                cell["ratio_ours_vs_raw"] = round(res["raw"]["median_ms"] / res["ours"]["median_ms"], 3)
                cell["ratio_ours_vs_raw_best"] = round(res["raw"]["min_ms"] / res["ours"]["min_ms"], 3)
                cell["ratio_vs_memcpy"] = {p: round(res["memcpy"]["median_ms"] / res[p]["median_ms"], 3)
                                           for p in names if p != "memcpy"}
                cell["ours_minus_raw_us"] = round(1e3 * (res["ours"]["median_ms"] - res["raw"]["median_ms"]), 1)
                if "raw_in_thread" in res:  # ours - raw = thread hop + the rest of our layer (medians)
                    cell["split_us"] = {
                        "thread_hop": round(1e3 * (res["raw_in_thread"]["median_ms"] - res["raw"]["median_ms"]), 1),
                        "rest_of_layer": round(1e3 * (res["ours"]["median_ms"] - res["raw_in_thread"]["median_ms"]), 1)}
                cells.append(cell)
                print(f"[{name}] {tokens:>5} tok {layout_name:<10} {len(paths.ops):>4} ops {paths.bytes / 2**20:6.1f} MiB"
                      + "".join(f"  {p} {res[p]['median_ms']:.2f} ms {res[p]['gbps']:.2f} GB/s" for p in names)
                      + f"  ours/raw {cell['ratio_ours_vs_raw']:.2f}", flush=True)
        phase = meter.done()
        phase["target_cpu_s"] = round(target.ask("cpu") - target_cpu0, 2)
        stats = backend.stats
        return {"backend": name, "startup_s": round(startup_s, 1), "target_pid": target.proc.pid,
                "cells": cells, "phase": phase,
                "backend_stats": {"writes": stats.writes, "bytes": stats.bytes, "seconds": round(stats.seconds, 3),
                                  "failures": stats.failures}}
    finally:
        backend.release()
        target.close()


# --- report ----------------------------------------------------------------------------------
def print_table(results: list[dict]) -> None:
    print()
    header = (f"{'backend':<9}{'tokens':>7} {'layout':<11}{'ops':>5}{'MiB':>7}  {'path':<15}{'p50 ms':>9}{'p90 ms':>9}"
              f"{'min ms':>9}{'GB/s':>8}{'/raw':>7}{'/memcpy':>9}")
    print(header)
    print("-" * len(header))
    for result in results:
        for cell in result["cells"]:
            for i, (p, r) in enumerate(cell["paths"].items()):
                lead = (f"{result['backend']:<9}{cell['tokens']:>7} {cell['layout']:<11}{cell['ops']:>5}"
                        f"{cell['bytes'] / 2**20:>7.1f}") if i == 0 else " " * 39
                vs_raw = cell["paths"]["raw"]["median_ms"] / r["median_ms"]
                vs_mem = cell["paths"]["memcpy"]["median_ms"] / r["median_ms"]
                print(f"{lead}  {p:<15}{r['median_ms']:>9.3f}{r['p90_ms']:>9.3f}{r['min_ms']:>9.3f}{r['gbps']:>8.2f}"
                      f"{vs_raw:>6.2f}x"
                      f"{vs_mem:>8.2f}x")
        print()
    print("/raw = raw median time / this path's median time (bandwidth ratio; goal for ours >= 0.9); /memcpy likewise;"
          " GB/s at the median")
    print()
    print("breakdown of our layer, parts timed in isolation (median us):")
    for result in results:
        for cell in result["cells"]:
            parts = ", ".join(f"{k} {v}" for k, v in cell["breakdown"].items() if k != "raw_phases")
            print(f"  {result['backend']:<9}{cell['tokens']:>6} {cell['layout']:<11} ours-raw "
                  f"{cell['ours_minus_raw_us']:>8.1f} us (min-based ratio {cell['ratio_ours_vs_raw_best']:.2f}) | {parts}")
            if "split_us" in cell:
                print(f"  {'':<28}ours - raw = thread hop (raw_in_thread - raw) {cell['split_us']['thread_hop']} us"
                      f" + rest of our layer (ours - raw_in_thread) {cell['split_us']['rest_of_layer']} us")
            if "raw_phases" in cell["breakdown"]:
                print(f"  {'':<28}raw nixl phases: {cell['breakdown']['raw_phases']}")


def plot(results: list[dict], path: Path, title: str) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, len(results), figsize=(6.5 * len(results), 4.8), squeeze=False)
    colors = {"ours": "tab:blue", "raw": "tab:orange", "raw_sync": "tab:green", "raw_sleep_poll": "tab:green",
              "raw_in_thread": "tab:purple", "memcpy": "grey"}
    for ax, result in zip(axes[0], results):
        for layout, style in (("contiguous", "-"), ("fragmented", "--")):
            cells = [c for c in result["cells"] if c["layout"] == layout]
            xs = [c["tokens"] for c in cells]
            for p in cells[0]["paths"]:
                ys = [c["paths"][p]["gbps"] for c in cells]
                lo = [c["paths"][p]["gbps"] - c["paths"][p]["gbps_p90_time"] for c in cells]
                ax.errorbar(xs, ys, yerr=[lo, [0] * len(lo)], fmt="o" + style, color=colors.get(p, None),
                            capsize=3, label=f"{p} ({layout})", alpha=0.9 if layout == "contiguous" else 0.6)
            for c in cells:
                ax.annotate(f"{c['ratio_ours_vs_raw']:.2f}x", (c["tokens"], c["paths"]["ours"]["gbps"]),
                            textcoords="offset points", xytext=(4, -12 if layout == "fragmented" else 6), fontsize=7,
                            color="tab:blue")
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_xlabel("prompt tokens (solid: contiguous remote blocks, dashed: fragmented)")
        ax.set_ylabel("GB/s at the median (bar down to p90 time), log scale")
        ax.set_yscale("log")
        ax.set_title(f"{result['backend']} (labels: ours/raw)", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.17))
    fig.suptitle(title, fontsize=10)
    save_figure(fig, path, bbox_inches="tight")


# --- main ------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = make_parser(__doc__)
    add_model_args(p, family_help="model family whose KV layout is used")
    p.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated transfer backends")
    p.add_argument("--tokens", default="512,2048,8192", help="comma-separated prompt lengths")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--reps", type=int, default=40,
                   help="timed repetitions per cell and path (4x up to 4 MiB, 2/3 of it from 32 MiB)")
    p.add_argument("--warmup", type=int, default=3, help="untimed moves per cell and path first")
    p.add_argument("--micro-iters", type=int, default=200, help="iterations of each breakdown part")
    p.add_argument("--initiator-cores", default="0", help="cores of this process (initiator, memcpy); '' = no pinning")
    p.add_argument("--target-cores", default="1", help="cores of the target process; '' = no pinning")
    p.add_argument("--timeout", type=float, default=30.0, help="TransferConfig.timeout_s")
    p.add_argument("--seed", type=int, default=0, help="seed of the fragmented block lists and the path order")
    add_output_args(p, "kv_transfer", quick_help="smoke run: 8 repetitions, 1 warm-up")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.reps, args.warmup, args.micro_iters = min(args.reps, 8), 1, min(args.micro_iters, 50)
    args.tokens = [int(t) for t in args.tokens.split(",") if t.strip()]
    backends = [b for b in args.backends.split(",") if b.strip()]
    initiator_cores, target_cores = pin_this_process(args.initiator_cores), parse_cores(args.target_cores)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    out = output_path(args)
    started = time.time()
    model = resolve_model(args)
    shape = layout_shape(model, args.block_size)

    import torch

    torch.set_num_threads(1)
    pool_blocks = POOL_HEADROOM * max(-(-t // args.block_size) for t in args.tokens)
    layout = make_layout(shape, pool_blocks)
    from stages.engine.kv_pool import KVPool

    source = KVPool(layout)
    source.tensor.copy_(torch.randn(source.tensor.shape, generator=torch.Generator().manual_seed(args.seed)))
    memcpy_dst = torch.zeros_like(source.tensor)
    print(f"layout {shape}, float32: {layout.block_bytes} B/block, {layout.bytes_per_token} B/token; pools of "
          f"{pool_blocks} blocks ({source.nbytes / 2**20:.0f} MiB) each side; initiator pid {os.getpid()} on cores "
          f"{initiator_cores or 'any'}, target on {target_cores or 'any'}; load {loadavg()}", flush=True)
    info = machine_info()
    try:
        dirty = subprocess.run(["git", "status", "--porcelain", "transfer"], cwd=REPO, capture_output=True, text=True,
                               timeout=10, check=False).stdout.split("\n")
        info["transfer_uncommitted"] = [line.strip() for line in dirty if line.strip()]
    except (OSError, subprocess.SubprocessError):
        pass
    results = [run_backend(name, args, shape, pool_blocks, source.tensor, memcpy_dst, target_cores)
               for name in backends]

    goal = {f"{r['backend']}/{c['tokens']}/{c['layout']}": c["ratio_ours_vs_raw"] for r in results for c in r["cells"]}
    report = {
        "benchmark": "kv_transfer",
        "machine": info,
        "pinning": {
            "initiator_and_memcpy": {"pid": os.getpid(), "cores": initiator_cores or None, "torch_threads": 1},
            "target": {"pids": {r["backend"]: r["target_pid"] for r in results}, "cores": target_cores or None},
            "note": "library threads (Mooncake TCP workers, NIXL/UCX progress thread) inherit their process's cores",
        },
        "config": {"family": args.family, "size": args.size, "model_dir": str(model),
                   "layout": {**shape, "dtype": "float32", "block_bytes": layout.block_bytes,
                              "bytes_per_token": layout.bytes_per_token, "pool_blocks": pool_blocks},
                   "tokens": args.tokens, "reps": args.reps, "warmup": args.warmup, "micro_iters": args.micro_iters,
                   "timeout_s": args.timeout, "seed": args.seed, "quick": args.quick, "paths": PATHS,
                   "gb": "1e9 bytes"},
        "results": results,
        "goal": {"ratio_ours_vs_raw": GOAL_RATIO, "ratios": goal,
                 "met": all(v >= GOAL_RATIO for v in goal.values()),
                 "below": {k: v for k, v in goal.items() if v < GOAL_RATIO}},
        "total_s": round(time.time() - started, 1),
    }
    write_json(out, report)
    png = out.with_suffix(".png")
    plot(results, png, f"KV move, {args.family}-{args.size} layout ({layout.block_bytes // 1024} KiB blocks), "
                       f"initiator core {args.initiator_cores or 'any'}, target core {args.target_cores or 'any'}")
    print_table(results)
    for r in results:
        ph = r["phase"]
        print(f"{r['backend']}: wall {ph['wall_s']} s, initiator cpu {ph['initiator_cpu_s']} s, target cpu "
              f"{ph['target_cpu_s']} s, core busy {ph['core_busy_fraction']}, load {ph['loadavg_1m']}; other processes: "
              + "; ".join(f"{p['cpu_s']} s core {p['last_core']} {p['cmd'][:60]}" for p in ph["other_processes"][:3]))
    print(f"goal ours/raw >= {GOAL_RATIO}: {'met' if report['goal']['met'] else 'NOT met'} "
          f"{report['goal']['below'] or ''}")
    print(f"wrote {out} and {png} ({report['total_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
