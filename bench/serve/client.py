"""One streamed chat request over aiohttp, timed from the client's side.

aiohttp's connections set TCP_NODELAY (``BaseProtocol.connection_made``), parse HTTP in C, and hand
over each read of the body as it arrives (``iter_any``), so a token chunk is timestamped when its bytes
reach this process, not when a line buffer fills."""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import dataclass, field
from functools import partial

import aiohttp

from bench.serve.stream import StreamTally, error_message

ERROR_BODY_BYTES = 64 * 1024  # of a non-200 answer, read for its message


@dataclass
class Outcome:
    """One request, as the client saw it. Times are ``time.perf_counter()`` seconds; ``latency`` is
    send -> end of the body; ``ttft`` send -> first token chunk; ``itl`` the gaps between token chunks.
    ``prompt_tokens`` / ``output_tokens`` come from the server's ``usage`` (None if it sent none).
    ``error`` (None when ``ok``) is a short message, the same for requests that failed the same way."""

    ok: bool
    start: float
    latency: float
    error: str | None = None
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    text: str = ""
    chunks: int = 0
    prompt_tokens: int | None = None
    output_tokens: int | None = None


def new_session(timeout_s: float) -> aiohttp.ClientSession:
    """A session for one run: no cap on connections (the runner caps concurrency), keep-alive, each
    request bounded by ``timeout_s`` in all."""
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=30)
    return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout_s))


async def send(session: aiohttp.ClientSession, url: str, payload: bytes, timeout_s: float) -> Outcome:
    """POST ``payload`` (a JSON chat body with ``stream: true``) to ``url`` and read the stream to its end.
    Never raises for what the server or the network does: that is a failed Outcome."""
    start = time.perf_counter()
    tally = StreamTally()
    try:
        async with session.post(url, data=payload, headers={"Content-Type": "application/json"}) as response:
            if response.status != 200:
                return Outcome(False, start, time.perf_counter() - start,
                               error=f"HTTP {response.status}: {await _error_text(response)}")
            async for data in response.content.iter_any():
                tally.feed(data, time.perf_counter())
            tally.close(time.perf_counter())
    except asyncio.TimeoutError:
        return Outcome(False, start, time.perf_counter() - start,
                       error=f"no complete answer within --request-timeout-s {timeout_s:g} s")
    except aiohttp.ClientConnectorError as exc:
        return Outcome(False, start, time.perf_counter() - start,
                       error=f"cannot connect to {exc.host}:{exc.port}: {_reason(exc.os_error)}")
    except (aiohttp.ClientError, OSError) as exc:
        return Outcome(False, start, time.perf_counter() - start, error=f"{type(exc).__name__}: {exc}")
    return _outcome(tally, start, time.perf_counter())


def _outcome(tally: StreamTally, start: float, end: float) -> Outcome:
    """A finished stream's Outcome: failed on an in-band error, or when it ended without ``[DONE]`` or a
    finish reason (cut off)."""
    times = tally.token_times
    usage = tally.usage or {}
    outcome = partial(Outcome, start=start, latency=end - start, ttft=times[0] - start if times else None,
                      itl=[b - a for a, b in zip(times, times[1:])], text=tally.text, chunks=len(times),
                      prompt_tokens=usage.get("prompt_tokens"), output_tokens=usage.get("completion_tokens"))
    if tally.error is not None:
        return outcome(False, error=f"error in the stream: {tally.error}")
    if not tally.done and tally.finish_reason is None:
        return outcome(False, error="the stream ended before [DONE] or a finish reason")
    return outcome(True)


def _reason(error: OSError) -> str:
    """``Connection refused`` rather than asyncio's ``Connect call failed ('127.0.0.1', 1)``."""
    return os.strerror(error.errno) if error.errno else str(error)


async def _error_text(response: aiohttp.ClientResponse) -> str:
    raw = await response.content.read(ERROR_BODY_BYTES)
    try:
        return error_message(json.loads(raw))
    except (json.JSONDecodeError, UnicodeDecodeError):
        return raw.decode(errors="replace").strip()[:200] or response.reason or "no body"
