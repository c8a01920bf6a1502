"""The client against one server: a lone long prompt's TTFT (one request at a time), and a phase of
running streams with, or without, long prompts arriving at a fixed period. Every request is streamed
through ``stage bench serve``'s client (aiohttp, each token chunk timed as its bytes arrive)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from bench.serve.client import Outcome, new_session, send
from bench.chunked_prefill.workload import long_payload, stream_payload


@dataclass(frozen=True)
class Load:
    """``streams`` closed-loop streams of ``stream_tokens``-token requests, each starting requests for
    ``duration_s`` (at most ``max_requests`` each); a long prompt (the next of ``longs``) every
    ``period_s`` while any stream runs (none without ``longs``)."""

    model: str
    streams: int
    stream_tokens: int
    duration_s: float
    max_requests: int
    longs: tuple[str, ...] = ()
    period_s: float = 2.0
    long_tokens: int = 8  # max_tokens of a long prompt


async def lone_ttft(url: str, model: str, texts: list[str], max_tokens: int, gap_s: float,
                    timeout_s: float) -> list[Outcome]:
    """Each of ``texts`` alone, one at a time, ``gap_s`` idle before each."""
    endpoint = f"{url}/v1/chat/completions"
    outcomes = []
    async with new_session(timeout_s) as session:
        for text in texts:
            await asyncio.sleep(gap_s)
            outcomes.append(await send(session, endpoint, long_payload(model, text, max_tokens), timeout_s))
    return outcomes


async def run_load(url: str, load: Load, timeout_s: float) -> dict:
    """The streams and the arrivals of ``load``; their Outcomes (per stream, in order) and the arrivals'
    send times from the phase's start."""
    endpoint = f"{url}/v1/chat/completions"
    by_stream: list[list[Outcome]] = [[] for _ in range(load.streams)]
    async with new_session(timeout_s) as session:
        t0 = time.perf_counter()

        async def stream(i: int) -> None:
            for k in range(load.max_requests):
                if time.perf_counter() - t0 >= load.duration_s:
                    break
                by_stream[i].append(await send(session, endpoint, stream_payload(load.model, i, k, load.stream_tokens),
                                               timeout_s))

        workers = [asyncio.create_task(stream(i)) for i in range(load.streams)]
        arrivals, sent_at = [], []
        for k, text in enumerate(load.longs):  # bounded by the texts given
            due = t0 + (k + 1) * load.period_s
            await asyncio.wait(workers, timeout=max(0.0, due - time.perf_counter()))
            if all(w.done() for w in workers):
                break
            sent_at.append(round(time.perf_counter() - t0, 3))
            arrivals.append(asyncio.create_task(send(session, endpoint, long_payload(load.model, text, load.long_tokens),
                                                     timeout_s)))
        await asyncio.gather(*workers)
        longs = list(await asyncio.gather(*arrivals))
        wall = time.perf_counter() - t0
    return {"streams": by_stream, "longs": longs, "long_sent_at_s": sent_at, "wall_s": round(wall, 2)}
