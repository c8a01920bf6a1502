"""The router's CPU at one fleet size: the fake fleet (``fleet.py``) and a pd-mode ``stage serve
router`` in front of it, its health checks and load sampling at their defaults; the router's CPU over
an idle interval, then over a bounded number of requests (``bench.router_overhead.client``)."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from argparse import Namespace
from pathlib import Path

from bench.common.children import Child
from bench.common.pinning import parse_cores
from bench.fleet_scale.analysis import idle_cores, per_request
from bench.router_overhead.client import TOKENS, Client, run_level
from process.ports import free_port

FLEET_START_S = 120.0


def measure(n: int, args: Namespace, out: Path) -> dict:
    """Router CPU with ``n`` prefills and ``n`` decodes: idle cores, then CPU per request."""
    ports_file = out.with_name(f"{out.stem}_fleet{n}.json")
    ports_file.unlink(missing_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    fleet = Child(f"fake fleet {n}", [sys.executable, "-m", "bench.fleet_scale.fleet", "--prefill", str(n),
                                      "--decode", str(n), "--ports-file", str(ports_file), "--tokens", str(TOKENS)],
                  parse_cores(args.fleet_cores), out.with_name(f"{out.stem}_fleet{n}.log"), env=env)
    router: Child | None = None
    try:
        deadline = time.monotonic() + FLEET_START_S
        while not ports_file.exists():
            if fleet.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the fake fleet of {n} did not start: see {fleet.log_path}")
            time.sleep(0.2)
        urls = json.loads(ports_file.read_text())
        port = free_port()
        argv = [sys.executable, "-m", "cli", "serve", "router", "--host", "127.0.0.1", "--port", str(port),
                *(x for u in urls["prefill"] for x in ("--prefill", u)),
                *(x for u in urls["decode"] for x in ("--decode", u)), "--log-level", "warning"]
        router = Child(f"router {n}", argv, parse_cores(args.router_cores),
                       out.with_name(f"{out.stem}_router{n}.log"), url=f"http://127.0.0.1:{port}", env=env)
        router.wait(args.startup_timeout)
        time.sleep(args.settle_s)  # past startup's discovery: the loops at their steady pace
        cpu0, t0 = router.cpu(precise=True), time.perf_counter()
        time.sleep(args.idle_s)
        idle_cpu, idle_wall = router.cpu(precise=True) - cpu0, time.perf_counter() - t0
        idle = idle_cores(idle_cpu, idle_wall)
        phases = {}
        for name, concurrency in (("c1", 1), (f"c{args.concurrency}", args.concurrency)):
            phases[name] = asyncio.run(_drive(router, concurrency, args.requests, max(20, 2 * n), args.phase_max_s,
                                              idle))
        return {"n": n, "workers": 2 * n, "idle": {"cpu_s": round(idle_cpu, 4), "wall_s": round(idle_wall, 2),
                                                    "cores": idle}, "phases": phases, "argv_flags": len(argv)}
    finally:
        if router is not None:
            router.stop()
        fleet.stop()
        ports_file.unlink(missing_ok=True)


async def _drive(router: Child, concurrency: int, requests: int, warmup: int, max_s: float,
                 idle: float | None) -> dict:
    """``requests`` chat requests (non-stream) at ``concurrency``, cut short at ``max_s``, after ``warmup``
    untimed ones (2N: every worker has its connections open); the router's CPU over the timed ones."""
    client = Client("ours", router.url, None)
    try:
        await run_level(client, concurrency, warmup, False)
        cpu0 = router.cpu(precise=True)
        samples, wall = await asyncio.wait_for(run_level(client, concurrency, requests, False), max_s)
        cpu = router.cpu(precise=True) - cpu0
    finally:
        await client.close()
    latencies = sorted(s.latency_s for s in samples)
    return {"sent": requests, "errors": client.errors[:5], "error_count": len(client.errors), "wall_s": round(wall, 3),
            "cpu_s": round(cpu, 4), "latency_p50_ms": round(1000 * latencies[len(latencies) // 2], 3) if latencies else None,
            **per_request(cpu, wall, len(samples), idle)}
