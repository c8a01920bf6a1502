"""One timed level against our server: the requests through the OpenAI client, the server's engine
steps (``/metrics``) and CPU seconds (``/proc``) around them."""

from __future__ import annotations

import asyncio
import re
import time
from argparse import Namespace
from collections import Counter

from bench.common.images import image_url
from bench.common.machine import loadavg
from bench.common.proc import cpu_seconds
from bench.decode_throughput.workload import workload


def scrape_metrics(base: str) -> dict[str, float]:
    """The server's Prometheus counters we use: steps and requests per step (batch-size histogram)."""
    import urllib.request

    with urllib.request.urlopen(f"{base}/metrics", timeout=10) as response:
        text = response.read().decode()
    values = {}
    for name in ("epd_batch_size_count", "epd_batch_size_sum", "epd_generation_tokens_total",
                 "epd_time_per_output_token_seconds_sum", "epd_time_per_output_token_seconds_count"):
        match = re.search(rf"^{name}\s+(\S+)$", text, re.M)
        if match:
            values[name] = float(match.group(1))
    return values


async def run_level(base: str, model_name: str, concurrency: int, n_requests: int, max_tokens: int,
                    timeout_s: float) -> dict:
    """``n_requests`` non-streaming requests, at most ``concurrency`` in flight (the official OpenAI
    client); wall time from the first send to the last answer, tokens/s, latencies, finish reasons."""
    from openai import AsyncOpenAI

    urls = {i: image_url(workload(i)[0]) for i in range(16)}
    client = AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=timeout_s)
    semaphore = asyncio.Semaphore(concurrency)
    latencies: list[float] = []

    async def one(index: int) -> tuple[int, int, str]:
        _, question = workload(index)
        async with semaphore:
            start = time.perf_counter()
            reply = await client.chat.completions.create(
                model=model_name,
                messages=[{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": urls[index % 16]}},
                    {"type": "text", "text": question}]}],
                max_tokens=max_tokens, temperature=0, stream=False, extra_body={"ignore_eos": True})
            latencies.append(time.perf_counter() - start)
        return reply.usage.completion_tokens, reply.usage.prompt_tokens, reply.choices[0].finish_reason

    try:
        start = time.perf_counter()
        results = await asyncio.gather(*(one(i) for i in range(n_requests)))
        wall = time.perf_counter() - start
    finally:
        await client.close()
    completion = sum(r[0] for r in results)
    short = [r for r in results if r[0] != max_tokens]
    latencies.sort()
    return {
        "concurrency": concurrency,
        "requests": n_requests,
        "completion_tokens": completion,
        "prompt_tokens_mean": round(sum(r[1] for r in results) / len(results), 1),
        "requests_short_of_max_tokens": len(short),
        "finish_reasons": dict(Counter(r[2] for r in results)),
        "wall_s": round(wall, 3),
        "tokens_per_s": round(completion / wall, 2),
        "latency_s_p50": round(latencies[len(latencies) // 2], 3),
        "latency_s_max": round(latencies[-1], 3),
    }


def measure_level(base: str, model_name: str, pid: int, concurrency: int, n: int, args: Namespace) -> dict:
    """One timed run at ``concurrency``, with the server's steps (from /metrics) and CPU time (from /proc)."""
    before = scrape_metrics(base)
    cpu_before, load_before = cpu_seconds(pid), loadavg()
    run = asyncio.run(run_level(base, model_name, concurrency, n, args.max_tokens, args.request_timeout))
    server_cpu = cpu_seconds(pid) - cpu_before
    after = scrape_metrics(base)
    steps = after.get("epd_batch_size_count", 0) - before.get("epd_batch_size_count", 0)
    batched = after.get("epd_batch_size_sum", 0) - before.get("epd_batch_size_sum", 0)
    run.update(
        server_cpu_s=round(server_cpu, 2),
        server_cpu_share=round(server_cpu / run["wall_s"], 2),  # < 1: idle gaps or other load on its core
        tokens_per_server_cpu_s=round(run["completion_tokens"] / server_cpu, 1) if server_cpu else None,
        loadavg_1m=[load_before, loadavg()],
        engine_steps=int(steps),
        mean_batch=round(batched / steps, 2) if steps else None,
        ms_per_step=round(1000 * run["wall_s"] / steps, 2) if steps else None,
    )
    return run
