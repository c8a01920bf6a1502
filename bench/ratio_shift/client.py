"""The closed-loop load over the phases, and the split sampled beside it.

``--clients`` clients each send one streamed chat at a time, the kind of the phase running when it
is sent, until the last phase ends; every request is recorded (times in seconds from the run's
start), a failure too (any non-200 answer, in-band error event, stream without content or transport
error). A sampler reads ``GET /admin/workers`` every ``--sample-s``."""

from __future__ import annotations

import asyncio
import itertools
import time
from argparse import Namespace

import httpx

from bench.common.chat_stream import stream_chat
from bench.ratio_shift.fleet import AUTH
from bench.ratio_shift.workload import Phase, chat_body, phase_at


def _stage_times(header: str | None) -> dict[str, float]:
    """``x-epd-stage-times`` (``encoder=0.01;prefill=0.02``) as a dict."""
    out: dict[str, float] = {}
    for part in (header or "").split(";"):
        name, _, value = part.partition("=")
        try:
            out[name.strip()] = round(float(value), 4)
        except ValueError:
            continue
    return out


async def _one(client: httpx.AsyncClient, url: str, phase: Phase, serial: int, args: Namespace, t0: float) -> dict:
    body = chat_body(phase.kind, serial, args)
    send = time.perf_counter() - t0
    record = {"phase": phase.name, "kind": phase.kind, "serial": serial, "send_s": round(send, 4)}
    try:
        chat = await stream_chat(client, url, body, t0)
    except Exception as exc:  # noqa: BLE001 - a failed request is a result
        return {**record, "ok": False, "end_s": round(time.perf_counter() - t0, 4),
                "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    tokens = int(chat.usage.get("completion_tokens") or args.max_tokens)
    return {**record, "ok": True, "ttft_s": round(chat.ttft_s - send, 4), "end_s": round(chat.total_s, 4),
            "tpot_s": round((chat.total_s - chat.ttft_s) / max(1, tokens - 1), 5), "tokens": tokens,
            "prompt_tokens": chat.usage.get("prompt_tokens"),
            "stage_times": _stage_times(chat.headers.get("x-epd-stage-times"))}


async def _client(url: str, phases: list[Phase], args: Namespace, serials: itertools.count, t0: float,
                  out: list[dict]) -> None:
    async with httpx.AsyncClient(timeout=args.request_timeout) as client:
        while (phase := phase_at(phases, time.perf_counter() - t0)) is not None:
            out.append(await _one(client, url, phase, next(serials), args, t0))


async def _sampler(url: str, period_s: float, t0: float, stop: asyncio.Event, out: list[dict]) -> None:
    async with httpx.AsyncClient(timeout=10, headers=AUTH) as client:
        while not stop.is_set():
            try:
                body = (await client.get(f"{url}/admin/workers")).raise_for_status().json()
                out.append({"t_s": round(time.perf_counter() - t0, 3),
                            "workers": [{k: w.get(k) for k in ("id", "role", "draining", "outstanding")}
                                        for w in body["workers"]]})
            except (httpx.HTTPError, ValueError) as exc:
                out.append({"t_s": round(time.perf_counter() - t0, 3), "error": str(exc)[:200]})
            try:
                await asyncio.wait_for(stop.wait(), period_s)
            except asyncio.TimeoutError:
                pass


async def drive(url: str, phases: list[Phase], args: Namespace, serials: itertools.count) -> tuple[list[dict], list[dict]]:
    """Run the phases against the router at ``url``: (requests, split samples), times from the start."""
    t0 = time.perf_counter()
    requests: list[dict] = []
    samples: list[dict] = []
    stop = asyncio.Event()
    sampler = asyncio.ensure_future(_sampler(url, args.sample_s, t0, stop, samples))
    await asyncio.gather(*(_client(url, phases, args, serials, t0, requests) for _ in range(args.clients)))
    stop.set()
    await sampler
    return sorted(requests, key=lambda r: r["send_s"]), samples
