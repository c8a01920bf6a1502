"""The client of a phase: one streamed request, to the colocated server or, for PD, to the prefill
and the decode at once with the bootstrap fields (as a PD router does), timed on the decode's
stream; the KV write the prefill counted and each server's CPU over it."""

from __future__ import annotations

import asyncio
import random
import time

from bench.common.chat_stream import stream_chat
from bench.common.children import Server


async def stream_reply(client, url: str, body: dict, t0: float) -> dict:
    """POST a streaming chat request; times (from ``t0``) of the role chunk, the first content chunk and the end."""
    reply = await stream_chat(client, url, body, t0)
    return {"ttft_s": reply.ttft_s, "first_chunk_s": reply.first_chunk_s, "total_s": reply.total_s, "text": reply.text,
            "prompt_tokens": reply.usage.get("prompt_tokens"), "completion_tokens": reply.usage.get("completion_tokens")}


async def transfer_stats(client, url: str) -> dict:
    """The prefill's KV transfer counters (``/server_info`` ``transfer``)."""
    response = await client.get(f"{url}/server_info")
    return response.json()["transfer"]


async def one_request(client, servers: dict[str, Server], body: dict, bootstrap_port: int | None) -> dict:
    """One timed request (``_one_request``) with each server's CPU seconds over it."""
    cpu0 = {role: server.cpu() for role, server in servers.items()}
    reply = await _one_request(client, servers, body, bootstrap_port)
    reply["server_cpu_s"] = {role: server.cpu() - cpu0[role] for role, server in servers.items()}
    return reply


async def _one_request(client, servers: dict[str, Server], body: dict, bootstrap_port: int | None) -> dict:
    if "colocated" in servers:
        t0 = time.perf_counter()
        return await stream_reply(client, servers["colocated"].url, body, t0)
    prefill, decode = servers["prefill"], servers["decode"]
    body = {**body, "bootstrap_host": "127.0.0.1", "bootstrap_port": bootstrap_port,
            "bootstrap_room": random.getrandbits(63)}
    before = await transfer_stats(client, prefill.url)

    async def prefill_side(t0: float) -> float:
        response = await client.post(f"{prefill.url}/v1/chat/completions", json=body)
        await response.aread()
        if response.status_code != 200:
            raise RuntimeError(f"prefill: HTTP {response.status_code}: {response.text[:500]}")
        return time.perf_counter() - t0

    t0 = time.perf_counter()
    prefill_done, reply = await asyncio.gather(prefill_side(t0), stream_reply(client, decode.url, body, t0))
    after = await transfer_stats(client, prefill.url)
    reply["prefill_reply_s"] = prefill_done
    reply["kv_write_s"] = after["seconds"] - before["seconds"]
    reply["kv_bytes"] = after["bytes"] - before["bytes"]
    reply["kv_writes"] = after["writes"] - before["writes"]
    return reply


async def measure(servers: dict[str, Server], bodies: dict[str, dict], requests: int, bootstrap_port: int | None,
                  timeout_s: float, gap_s: float) -> dict[str, list[dict]]:
    """One untimed request per workload, then ``requests`` rounds of all workloads, one request at a
    time with ``gap_s`` idle before each; samples per workload."""
    import httpx

    samples: dict[str, list[dict]] = {w: [] for w in bodies}
    async with httpx.AsyncClient(timeout=timeout_s) as client:
        for workload, body in bodies.items():  # warm-up: one of each, untimed
            samples[workload].append({**await one_request(client, servers, body, bootstrap_port), "warmup": True})
        for _ in range(requests):  # interleaved, one request at a time, an idle gap between them
            for workload, body in bodies.items():
                await asyncio.sleep(gap_s)
                samples[workload].append(await one_request(client, servers, body, bootstrap_port))
    return samples
