"""One streamed request through the router (TTFT, text, usage) and one conversation of them."""

from __future__ import annotations

import asyncio

from bench.common import chat_stream
from bench.prefix_cache.workload import TURNS, chat_body


async def stream_chat(client, url: str, body: dict) -> dict:
    """POST a streaming chat request; TTFT and total (s), the text, prompt and cached tokens."""
    reply = await chat_stream.stream_chat(client, url, body)
    if not reply.usage:
        raise RuntimeError(f"{url}: the stream carried no usage")
    return {"ttft_s": reply.ttft_s, "total_s": reply.total_s, "text": reply.text,
            "prompt_tokens": reply.usage["prompt_tokens"],
            "cached_tokens": (reply.usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
            "room": reply.room}


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
