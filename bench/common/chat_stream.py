"""One streamed chat completion read off the wire with httpx, timed: what the latency benches measure.

Callers: bench/ttft_pd, bench/epd_cache, bench/prefix_cache. A non-200 answer, an in-band error
event or a stream without content raises RuntimeError naming the URL."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field


@dataclass
class StreamedChat:
    """Times in seconds from the caller's ``t0`` (``time.perf_counter``)."""

    first_chunk_s: float  # the first data event (the role chunk)
    ttft_s: float  # the first content
    total_s: float  # the end of the stream
    text: str
    usage: dict = field(default_factory=dict)  # the last chunk's usage ({} if none came)
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def room(self) -> int | None:
        """The bootstrap room the router gave the request (its ``x-epd-room`` header)."""
        room = self.headers.get("x-epd-room")
        return int(room) if room else None


async def stream_chat(client, url: str, body: dict, t0: float | None = None) -> StreamedChat:
    """POST ``body`` (with ``"stream": true``) to ``url``'s /v1/chat/completions on the httpx
    ``client``; ``t0`` defaults to now."""
    t0 = time.perf_counter() if t0 is None else t0
    first_chunk = first_content = None
    pieces: list[str] = []
    usage: dict = {}
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            raise RuntimeError(f"{url}: HTTP {response.status_code}: {response.text[:500]}")
        headers = dict(response.headers)
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.perf_counter() - t0
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"{url}: in-band error {chunk['error']}")
            first_chunk = now if first_chunk is None else first_chunk
            for choice in chunk.get("choices") or []:
                if (choice.get("delta") or {}).get("content"):
                    pieces.append(choice["delta"]["content"])
                    first_content = now if first_content is None else first_content
            usage = chunk.get("usage") or usage
    if first_chunk is None or first_content is None:
        raise RuntimeError(f"{url}: the stream carried no content")
    return StreamedChat(first_chunk, first_content, time.perf_counter() - t0, "".join(pieces), usage, headers)
