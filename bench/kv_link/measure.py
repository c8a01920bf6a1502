"""One backend's run on the rig: the sink on one host, the source on another, connected; each cell's
paths checked (bytes and link) once, warmed up, then timed in a shuffled order per repetition."""

from __future__ import annotations

import random
import time
from argparse import Namespace

from bench.common.meter import CpuMeter
from bench.common.proc import cpu_seconds
from bench.kv_link.analysis import cell_ratios, crossed_link, summarize
from bench.kv_link.workload import Cell, reps_for
from bench.kv_link.worker import Worker

PATHS = ("ours", "raw", "tcp")


def run_backend(name: str, args: Namespace, rig, shape: dict, pool: int, cells: list[Cell]) -> dict:
    """Every cell of backend ``name`` from ``args.source_host`` to ``args.sink_host`` of ``rig``."""
    started = time.perf_counter()
    sink_addr = rig.addr(args.sink_host)
    env = worker_env(name, args.ucx_tls)
    sink = Worker("sink", rig.ns(args.sink_host), args.sink_cores, name, sink_addr, shape, pool, args.timeout,
                  args.seed, args.tcp_chunk_kib * 1024, env)
    source = None
    try:
        source = Worker("source", rig.ns(args.source_host), args.source_cores, name, rig.addr(args.source_host),
                        shape, pool, args.timeout, args.seed, args.tcp_chunk_kib * 1024, env)
        source.ask("connect", (sink.info["descriptor"], sink_addr, sink.info["tcp_port"]))
        startup_s = time.perf_counter() - started
        print(f"[{name}] source pid {source.info['pid']} on {args.source_host} ({rig.addr(args.source_host)}), "
              f"sink pid {sink.info['pid']} on {args.sink_host} ({sink_addr}), up in {startup_s:.1f} s", flush=True)
        pids = {"source": source.info["pid"], "sink": sink.info["pid"]}
        meter = CpuMeter(set(pids.values()), cpu_key="parent_cpu_s")
        cpu0 = {role: cpu_seconds(pid) for role, pid in pids.items()}
        rng = random.Random(args.seed)
        out = [_cell(source, sink, cell, args, rng, name) for cell in cells]
        phase = meter.done()
        phase.update({f"{role}_cpu_s": round(cpu_seconds(pid) - cpu0[role], 2) for role, pid in pids.items()})
        return {"backend": name, "env": env, "startup_s": round(startup_s, 1), "pids": pids, "cells": out,
                "phase": phase}
    finally:
        if source is not None:
            source.close()
        sink.close()


def worker_env(backend: str, ucx_tls: str) -> dict[str, str]:
    """The workers' extra environment: for nixl, ``UCX_TLS=ucx_tls`` unless empty (see ``--ucx-tls``)."""
    return {"UCX_TLS": ucx_tls} if backend == "nixl" and ucx_tls else {}


def _cell(source: Worker, sink: Worker, cell: Cell, args: Namespace, rng: random.Random, name: str) -> dict:
    shape = source.ask("cell", (cell.local_ids, list(cell.remote_ids)))
    wire = {p: crossed_link(**_verify(source, sink, cell, p), payload=shape["bytes"]) for p in PATHS}
    for _ in range(args.warmup):
        for p in PATHS:
            source.ask("run", p)
    times: dict[str, list[float]] = {p: [] for p in PATHS}
    order = list(PATHS)
    for _ in range(reps_for(args.reps, cell.mib)):
        rng.shuffle(order)
        for p in order:
            times[p].append(source.ask("run", p))
    res = {p: summarize(times[p], shape["bytes"]) for p in PATHS}
    out = {"mib": cell.mib, "layout": cell.layout, "blocks": cell.blocks, "ops": shape["ops"],
           "bytes": shape["bytes"], "verified": True, "wire": wire, "paths": res, **cell_ratios(res)}
    print(f"[{name}] {cell.mib:>3} MiB {cell.layout:<10} {shape['ops']:>4} ops"
          + "".join(f"  {p} {res[p]['median_ms']:.1f} ms {res[p]['gbps']:.2f} GB/s (wire {wire[p]['wire_ratio']}, "
                    f"{wire[p]['tcp_opens']} opens)"
                    for p in PATHS)
          + f"  ours/tcp {out['ours_vs_tcp']:.2f} raw/tcp {out['raw_vs_tcp']:.2f}", flush=True)
    return out


def _verify(source: Worker, sink: Worker, cell: Cell, path: str) -> dict:
    """Zero the sink's blocks, move once (counting the source link's bytes and TCP connections opened),
    compare the hashes of the sink's blocks and the source's; RuntimeError on a mismatch. Returns
    {wire_bytes, tcp_opens}."""
    sink.ask("zero", list(cell.remote_ids))
    seen = source.ask("wire", path)
    want, got = source.ask("digest", cell.local_ids), sink.ask("digest", list(cell.remote_ids))
    if want != got:
        raise RuntimeError(f"{path} {cell.mib} MiB {cell.layout}: the sink's blocks differ from the source's")
    return {"wire_bytes": seen["bytes"], "tcp_opens": seen["tcp_opens"]}
