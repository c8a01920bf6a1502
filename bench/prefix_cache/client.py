"""One streamed request through the router (TTFT, text, usage) and one conversation of them."""

from __future__ import annotations

import asyncio
import json
import time

from bench.prefix_cache.workload import TURNS, chat_body


async def stream_chat(client, url: str, body: dict) -> dict:
    """POST a streaming chat request; TTFT and total (s), the text, prompt and cached tokens."""
    first_content, pieces, usage = None, [], None
    t0 = time.perf_counter()
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            raise RuntimeError(f"{url}: HTTP {response.status_code}: {response.text[:500]}")
        room = response.headers.get("x-epd-room")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"{url}: in-band error {chunk['error']}")
            for choice in chunk.get("choices") or []:
                if text := (choice.get("delta") or {}).get("content"):
                    pieces.append(text)
                    first_content = first_content if first_content is not None else time.perf_counter() - t0
            usage = chunk.get("usage") or usage
    if first_content is None or usage is None:
        raise RuntimeError(f"{url}: the stream carried no content or no usage")
    return {"ttft_s": first_content, "total_s": time.perf_counter() - t0, "text": "".join(pieces),
            "prompt_tokens": usage["prompt_tokens"],
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
            "room": int(room) if room else None}


async def prefill_seconds(client, prefill_url: str, room: int) -> float | None:
    """The prefill's forward pass of ``room`` (its timeline: ``prefilled`` - ``embeddings_ready``), in s."""
    response = await client.get(f"{prefill_url}/rooms/{room}")
    if response.status_code != 200:
        return None
    at = {event["event"]: event["t"] for event in response.json()["events"]}
    start = at.get("embeddings_ready", at.get("paired"))
    return at["prefilled"] - start if "prefilled" in at and start is not None else None


async def conversation(url: str, image_url: str, max_tokens: int, gap_s: float, timeout_s: float,
                       turns: int = TURNS, prefill_url: str | None = None) -> list[dict]:
    """``turns`` turns of one conversation, one request at a time; each turn's sample (with the
    prefill's forward-pass time from its room timeline, given ``prefill_url``)."""
    import httpx

    answers: list[str] = []
    samples = []
    async with httpx.AsyncClient(timeout=timeout_s) as client:
        for turn in range(1, turns + 1):
            await asyncio.sleep(gap_s)
            sample = await stream_chat(client, url, chat_body(image_url, answers, max_tokens))
            if prefill_url is not None and sample["room"] is not None:
                sample["prefill_s"] = await prefill_seconds(client, prefill_url, sample["room"])
            samples.append({"turn": turn, **sample})
            answers.append(sample["text"])
    return samples
