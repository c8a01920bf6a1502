"""The soak's load: the ramp that measures capacity (closed loop, rising concurrency) and the hold
(open loop at a fixed rate, in-flight bounded), both through the router with ``bench.overload.client``."""

from __future__ import annotations

import asyncio
import time

import httpx

from bench.overload.client import one

GAIN = 1.05  # a ramp step must beat the best so far by 5% for the ramp to go on


async def ramp(url: str, concurrencies: list[int], step_s: float, max_tokens: int, timeout_s: float) -> list[dict]:
    """For each concurrency in turn: that many clients send requests back to back for ``step_s``
    seconds; a step's ``ok_per_s`` is its 200s over its wall time (requests still running at the end
    are waited for and counted). Stops after the first step that does not beat the best by ``GAIN``
    or that got a refusal (the stack is saturated). Returns the steps."""
    steps: list[dict] = []
    best = 0.0
    async with httpx.AsyncClient(timeout=timeout_s, limits=httpx.Limits(max_connections=max(concurrencies))) as client:
        for c in concurrencies:
            t0 = time.monotonic()
            records: list[dict] = []

            async def loop(k: int) -> None:
                i = 0
                while time.monotonic() - t0 < step_s:
                    records.append(await one(client, url, k * 1_000_000 + i, max_tokens, t0))
                    i += 1

            await asyncio.gather(*(loop(k) for k in range(c)))
            wall = time.monotonic() - t0
            ok = sum(1 for r in records if r["status"] == 200)
            steps.append({"concurrency": c, "requests": len(records), "ok": ok, "wall_s": round(wall, 2),
                          "ok_per_s": round(ok / wall, 2), "refused": len(records) - ok})
            if ok / wall < best * GAIN or ok < len(records):
                break
            best = ok / wall
    return steps


async def hold(url: str, rate_per_s: float, duration_s: float, max_in_flight: int, max_tokens: int,
               timeout_s: float) -> tuple[list[dict], int]:
    """Requests started every ``1 / rate_per_s`` seconds for ``duration_s`` (on a fixed schedule, not
    waiting for answers), at most ``max_in_flight`` at once: an arrival that finds that many running
    is skipped and counted. Waits for the last answers (each bounded by ``timeout_s``). Returns the
    outcome records and the skipped count."""
    records: list[dict] = []
    skipped = 0
    tasks: set[asyncio.Task] = set()
    limits = httpx.Limits(max_connections=max_in_flight, max_keepalive_connections=max_in_flight)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        t0 = time.monotonic()
        i = 0
        while (due := t0 + i / rate_per_s) < t0 + duration_s:
            await asyncio.sleep(max(0.0, due - time.monotonic()))  # the schedule, not a synchronization
            if len(tasks) >= max_in_flight:
                skipped += 1
            else:
                task = asyncio.create_task(_keep(records, one(client, url, i, max_tokens, t0)))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            i += 1
        await asyncio.gather(*tasks)
    return records, skipped


async def _keep(records: list[dict], coro) -> None:
    records.append(await coro)
