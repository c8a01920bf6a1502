"""One backend's run: the target process, our backend connected to it, and every cell's paths
checked, warmed up and timed, interleaved in a random order within each repetition."""

from __future__ import annotations

import os
import random
import time
from argparse import Namespace

from bench.common.meter import CpuMeter
from bench.common.proc import cpu_seconds
from bench.kv_transfer.analysis import cell_ratios, summarize
from bench.kv_transfer.breakdown import breakdown
from bench.kv_transfer.layout import fragmented_ids, make_layout, reps_for
from bench.kv_transfer.paths import PATHS, Paths, verify
from bench.kv_transfer.target import Target


def run_backend(name: str, args: Namespace, shape: dict, pool_blocks: int, src, dst, target_cores: list[int]) -> dict:
    """Every cell (prompt length x remote layout) of backend ``name``: each path checked once, warmed up,
    then timed ``reps_for`` times in a shuffled order per repetition; the phase's CPU meters."""
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
        target_cpu0 = cpu_seconds(target.proc.pid)
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
                res = {p: summarize(times[p], paths.bytes) for p in names}
                cell = {"tokens": tokens, "layout": layout_name, "blocks": n, "ops": len(paths.ops),
                        "bytes": paths.bytes, "verified": True, "paths": res,
                        "breakdown": breakdown(paths, args.micro_iters), **cell_ratios(res)}
                cells.append(cell)
                print(f"[{name}] {tokens:>5} tok {layout_name:<10} {len(paths.ops):>4} ops {paths.bytes / 2**20:6.1f} MiB"
                      + "".join(f"  {p} {res[p]['median_ms']:.2f} ms {res[p]['gbps']:.2f} GB/s" for p in names)
                      + f"  ours/raw {cell['ratio_ours_vs_raw']:.2f}", flush=True)
        phase = meter.done()
        phase["target_cpu_s"] = round(cpu_seconds(target.proc.pid) - target_cpu0, 2)
        stats = backend.stats
        return {"backend": name, "startup_s": round(startup_s, 1), "target_pid": target.proc.pid,
                "cells": cells, "phase": phase,
                "backend_stats": {"writes": stats.writes, "bytes": stats.bytes, "seconds": round(stats.seconds, 3),
                                  "failures": stats.failures}}
    finally:
        backend.release()
        target.close()
