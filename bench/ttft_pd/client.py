"""The client of a phase: one streamed request, to the colocated server or, for PD, to the prefill
and the decode at once with the bootstrap fields (as a PD router does), timed on the decode's
stream; the KV write the prefill counted, each server's CPU over it and, for PD, both servers' room
timelines (``GET /rooms/{room}``, read once the reply has ended)."""

from __future__ import annotations

import asyncio
import random
import time

from bench.common.chat_stream import stream_chat
from bench.common.children import Server
from bench.ttft_pd.workload import Bodies, request_number


async def stream_reply(client, url: str, body: dict, t0: float) -> dict:
    """POST a streaming chat request; times (from ``t0``) of the role chunk, the first content chunk and the end."""
    reply = await stream_chat(client, url, body, t0)
    return {"ttft_s": reply.ttft_s, "first_chunk_s": reply.first_chunk_s, "total_s": reply.total_s, "text": reply.text,
            "prompt_tokens": reply.usage.get("prompt_tokens"), "completion_tokens": reply.usage.get("completion_tokens"),
            "cached_tokens": (reply.usage.get("prompt_tokens_details") or {}).get("cached_tokens")}


async def room_events(client, url: str, room: int) -> list[dict] | None:
    """A server's timeline of ``room`` (its events, wall-clock ``t``); None if it kept none."""
    response = await client.get(f"{url}/rooms/{room}")
    return response.json()["events"] if response.status_code == 200 else None


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
    room = random.getrandbits(63)
    body = {**body, "bootstrap_host": "127.0.0.1", "bootstrap_port": bootstrap_port, "bootstrap_room": room}
    before = await transfer_stats(client, prefill.url)

    async def prefill_side(t0: float) -> float:
        response = await client.post(f"{prefill.url}/v1/chat/completions", json=body)
        await response.aread()
        if response.status_code != 200:
            raise RuntimeError(f"prefill: HTTP {response.status_code}: {response.text[:500]}")
        return time.perf_counter() - t0

    sent, t0 = time.time(), time.perf_counter()  # the wall clock the servers' timelines use, and the timer
    prefill_done, reply = await asyncio.gather(prefill_side(t0), stream_reply(client, decode.url, body, t0))
    after = await transfer_stats(client, prefill.url)
    reply["room"], reply["sent_t"] = room, sent
    reply["prefill_events"] = await room_events(client, prefill.url, room)
    reply["decode_events"] = await room_events(client, decode.url, room)
    reply["prefill_reply_s"] = prefill_done
    reply["kv_write_s"] = after["seconds"] - before["seconds"]
    reply["kv_bytes"] = after["bytes"] - before["bytes"]
    reply["kv_writes"] = after["writes"] - before["writes"]
    return reply


async def measure(servers: dict[str, Server], bodies: Bodies, args, round_index: int,
                  bootstrap_port: int | None) -> dict[str, list[dict]]:
    """One untimed request per workload, then ``args.requests`` rounds of all workloads, one request
    at a time with ``args.gap_s`` idle before each; samples per workload, each with its request
    ``number`` (``workload.request_number``: the same prompts in every phase of a round)."""
    import httpx

    samples: dict[str, list[dict]] = {w: [] for w in bodies.workloads}

    async def timed(workload: str, index: int) -> None:
        number = request_number(workload, round_index, index)
        reply = await one_request(client, servers, bodies.body(workload, number), bootstrap_port)
        samples[workload].append({**reply, "number": number, **({"warmup": True} if index < 0 else {})})

    async with httpx.AsyncClient(timeout=args.request_timeout) as client:
        for workload in bodies.workloads:  # warm-up: one of each, untimed
            await timed(workload, -1)
        for index in range(args.requests):  # interleaved, one request at a time, an idle gap between them
            for workload in bodies.workloads:
                await asyncio.sleep(args.gap_s)
                await timed(workload, index)
    return samples
