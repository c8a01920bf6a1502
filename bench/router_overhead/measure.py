"""One target's round: warm-up, then the three phases (``c1``, ``stream``, ``c32``), each with its
samples, wall time, the router's CPU seconds (its process tree, from /proc) and how many calls the
fake pair counted per stage; and py-spy on our router during one more c=32 run."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time
from argparse import Namespace
from pathlib import Path

import aiohttp

from bench.common.children import Child
from bench.common.stats import py_spy_summary
from bench.router_overhead.analysis import STAGE_CALLS
from bench.router_overhead.client import Client, run_level

PY_SPY_ATTACH_S = 1.0
PY_SPY_STOP_S = 30.0


async def stats_of(session: aiohttp.ClientSession, url: str) -> dict:
    """The fake pair's request counters (``GET /bench/stats``)."""
    async with session.get(url + "/bench/stats") as r:
        return await r.json()


def measure_target(target: str, router: Child | None, prefill: str, decode: str, bootstrap: int,
                   args: Namespace, images: list[str] | None = None) -> dict:
    """``measure`` of one target: through ``router``, or direct to the pair when it is None; ``images``:
    each request carries the next one (the EPD targets)."""

    async def run() -> dict:
        client = Client(target, router.url if router else "", None if router else (prefill, decode, bootstrap),
                        images)
        try:
            return await measure(client, router, decode, args)
        finally:
            await client.close()

    return asyncio.run(run())


async def measure(client: Client, router: Child | None, backend_url: str, args: Namespace) -> dict:
    """One round of one target: warm-up, then the three phases; samples and CPU per phase."""
    await run_level(client, 4, args.warmup, False)
    await run_level(client, 1, max(args.warmup // 4, 5), True)
    out: dict = {}
    for phase, concurrency, n, stream in (("c1", 1, args.requests_c1, False), ("stream", 1, args.requests_stream, True),
                                          ("c32", args.concurrency, args.requests_c32, False)):
        before = await stats_of(client.session, backend_url)
        cpu0 = router.cpu(precise=True) if router else None
        errors0 = len(client.errors)
        samples, wall = await run_level(client, concurrency, n, stream)
        cpu = router.cpu(precise=True) - cpu0 if router and cpu0 is not None else None
        after = await stats_of(client.session, backend_url)
        reached = {k: after.get(k, 0) - before.get(k, 0) for k in STAGE_CALLS}
        out[phase] = {"samples": samples, "wall_s": wall, "router_cpu_s": cpu, "errors": client.errors[errors0:],
                      "reached": reached, "sent": n}
    return out


def profile(router: Child, venv: Path, out: Path, args: Namespace) -> dict | None:
    """py-spy (from the peers' venv) on our router during one more c=32 run: raw stacks + a summary
    (None without py-spy)."""
    py_spy = venv / "bin" / "py-spy"
    if not py_spy.exists():
        return None
    raw = out.with_name(out.stem + "_pyspy_ours.txt")
    spy = subprocess.Popen([str(py_spy), "record", "--pid", str(router.proc.pid), "--format", "raw", "--rate", "250",
                            "--output", str(raw), "--nonblocking"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(PY_SPY_ATTACH_S)

    async def load() -> None:
        client = Client("ours", router.url, None)
        try:
            await run_level(client, args.concurrency, args.requests_c32, False)
        finally:
            await client.close()

    asyncio.run(load())
    spy.send_signal(signal.SIGINT)
    try:
        spy.wait(PY_SPY_STOP_S)
    except subprocess.TimeoutExpired:
        spy.kill()
    return {"raw": str(raw), **py_spy_summary(raw)} if raw.exists() else None
