"""The client of a phase: one timed request through the router (TTFT, text, the room) with, for an
EPD system, the prefill's and the encoder's room events; a phase's sequence."""

from __future__ import annotations

import asyncio

from bench.common.chat_stream import stream_chat
from bench.prefill_overlap.stack import System
from bench.prefill_overlap.workload import Bodies, Request


async def events(client, url: str, room: int | None) -> list[dict] | None:
    """A server's timeline of ``room`` (None: none kept, or no room)."""
    if room is None:
        return None
    response = await client.get(f"{url}/rooms/{room}")
    return response.json()["events"] if response.status_code == 200 else None


async def one_request(client, system: System, bodies: Bodies, request: Request) -> dict:
    reply = await stream_chat(client, system.url, bodies.body(request))
    out = {"n": request.n, "index": request.index, "round": request.round, "number": request.number,
           "warmup": request.warmup, "ttft_s": reply.ttft_s, "total_s": reply.total_s, "text": reply.text,
           "prompt_tokens": reply.usage.get("prompt_tokens"),
           "cached_tokens": (reply.usage.get("prompt_tokens_details") or {}).get("cached_tokens"), "room": reply.room}
    if "prefill" in system.children:
        out["prefill_events"] = await events(client, system.children["prefill"].url, reply.room)
        out["encoder_events"] = await events(client, system.children["encoder"].url, reply.room)
    return out


async def measure(system: System, bodies: Bodies, plan: list[Request], args) -> list[dict]:
    """The plan's requests one at a time, ``args.gap_s`` idle before each."""
    import httpx

    samples = []
    async with httpx.AsyncClient(timeout=args.request_timeout) as client:
        for request in plan:
            await asyncio.sleep(args.gap_s)
            samples.append(await one_request(client, system, bodies, request))
    return samples
