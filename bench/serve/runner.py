"""One run: every request sent at its arrival offset, at most ``max_concurrency`` in flight, a progress
bar on stderr. The bodies are serialized before the clock starts, so the send loop only posts bytes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass

from bench.serve import arrivals
from bench.serve.client import Outcome, new_session, send
from bench.serve.config import Load, Target
from bench.serve.workload import Request


@dataclass(frozen=True)
class Run:
    """The Outcomes in request order; ``duration`` first send -> last answer's end (s); the client
    process's CPU seconds over that time (near ``duration``: the client, not the server, set the pace)."""

    outcomes: list[Outcome]
    duration: float
    client_cpu_s: float


def payloads(requests: list[Request], target: Target) -> list[bytes]:
    """Each request's JSON body: its fields, then the run's model, streaming with usage, temperature
    and ignore_eos."""
    run_fields = {"model": target.model, "stream": True, "stream_options": {"include_usage": True},
                  "temperature": target.temperature, "ignore_eos": target.ignore_eos}
    return [json.dumps({**request.body(), **run_fields}, separators=(",", ":")).encode() for request in requests]


async def run(bodies: list[bytes], target: Target, load: Load, *, warmup: int = 0, progress: bool = True,
              label: str = "requests") -> Run:
    """Send ``warmup`` untimed requests (the first bodies, one at a time), then every body at its offset
    (``arrivals.offsets``) under the concurrency cap; wait for all of them."""
    from tqdm import tqdm

    offsets = arrivals.offsets(len(bodies), load)
    cap = asyncio.Semaphore(load.max_concurrency) if load.max_concurrency else contextlib.nullcontext()
    async with new_session(target.request_timeout_s) as session:
        for index in range(warmup):
            await send(session, target.chat_url, bodies[index % len(bodies)], target.request_timeout_s)
        with tqdm(total=len(bodies), desc=label, unit="req", disable=not progress, dynamic_ncols=True) as bar:
            failed = 0

            async def one(index: int) -> Outcome:
                nonlocal failed
                delay = t0 + offsets[index] - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                async with cap:
                    outcome = await send(session, target.chat_url, bodies[index], target.request_timeout_s)
                if not outcome.ok:
                    failed += 1
                    bar.set_postfix(failed=failed, refresh=False)
                bar.update(1)
                return outcome

            t0, cpu0 = time.perf_counter(), time.process_time()
            outcomes = await asyncio.gather(*(one(i) for i in range(len(bodies))))
            duration, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    return Run(list(outcomes), duration, cpu)
