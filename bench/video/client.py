"""The client of a phase: one timed video chat through the router (TTFT, the prefix cache's hit
tokens, the encoder's videos around it), the miss/hit sequence, the encoder's frames per second
alone and batched (``POST /v1/encode`` straight to it), and a long stream's token gaps with and
without a video request arriving beside it. Every loop is bounded by its count and every request by
``--request-timeout``."""

from __future__ import annotations

import asyncio
import json
import random
import time

from bench.common import chat_stream
from bench.common.proc import cpu_seconds
from bench.video.workload import FOLLOW_UP, Pair, chat_body, encode_body, make_video, stream_body

PREFIX_HITS = "epd_prefix_cache_hit_tokens_total"
VIDEOS_ENCODED = "epd_encoder_videos_encoded_total"
ROOM_BITS = 62


def samples(text: str) -> dict[str, float]:
    """Every unlabelled sample of a Prometheus text page (histogram sums and counts included), by name."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.labels:
                out[sample.name] = sample.value
    return out


async def scrape(client, url: str | None) -> dict[str, float]:
    if url is None:
        return {}
    response = await client.get(f"{url}/metrics")
    response.raise_for_status()
    return samples(response.text)


def moved(before: dict[str, float], after: dict[str, float], keep=lambda name: True) -> dict[str, float]:
    """The samples that changed between two scrapes (``keep``: which names), rounded."""
    return {k: round(v - before.get(k, 0.0), 6) for k, v in after.items() if keep(k) and v != before.get(k, 0.0)}


async def timed_chat(client, router: str, body: dict, kv_url: str, encoder_url: str | None) -> dict:
    """One streamed request through the router: TTFT, end, prompt and cached tokens (usage), the KV
    server's prefix-cache hit tokens over it (colocated or the prefill) and, in epd, the videos the
    encoder ran through its tower over it."""
    kv0, enc0 = await scrape(client, kv_url), await scrape(client, encoder_url)
    reply = await chat_stream.stream_chat(client, router, body)
    kv1, enc1 = await scrape(client, kv_url), await scrape(client, encoder_url)
    details = reply.usage.get("prompt_tokens_details") or {}
    return {"ttft_s": reply.ttft_s, "total_s": reply.total_s, "text": reply.text,
            "prompt_tokens": reply.usage.get("prompt_tokens"), "cached_tokens": details.get("cached_tokens"),
            "prefix_hit_tokens": kv1.get(PREFIX_HITS, 0.0) - kv0.get(PREFIX_HITS, 0.0),
            "videos_encoded": (enc1.get(VIDEOS_ENCODED, 0.0) - enc0.get(VIDEOS_ENCODED, 0.0)) if encoder_url else None,
            "stage_times": reply.headers.get("x-epd-stage-times")}


async def measure_ttft(router: str, pairs: list[Pair], args, kv_url: str, encoder_url: str | None) -> list[dict]:
    """Every pair's miss then hit, one request at a time, ``gap_s`` idle before each (a follow-up pair:
    the video before the question)."""
    import httpx

    out = []
    async with httpx.AsyncClient(timeout=args.request_timeout) as client:
        for pair in pairs:
            video = make_video(pair.seed, *args.video_shape)
            for case, question in zip(pair.cases, pair.questions):
                await asyncio.sleep(args.gap_s)
                body = chat_body(video, question, pair.frames, args.max_tokens, video_first=pair.kind == FOLLOW_UP)
                reply = await timed_chat(client, router, body, kv_url, encoder_url)
                out.append({**reply, "frames": pair.frames, "kind": pair.kind, "case": case, "index": pair.index,
                            "warmup": pair.index < 0, "seed": pair.seed})
    return out


async def measure_encoder(encoder_url: str, args, seeds) -> dict:
    """Frames per second of one encoder: ``encoder_trials`` videos one at a time, then ``encoder_trials``
    rounds of ``encoder_batch`` videos sent at once (each its own request), every video new
    (``seeds``: an iterator of fresh seeds) and sampled at ``encoder_frames`` frames within the
    encoder's own sampling (``/server_info`` ``video``). Per part: each answer's ``seconds`` (arrival ->
    embedding in the cache), the client's wall time, and the encoder's metrics that moved."""
    import httpx

    from contract.video import VideoSampling, within

    async with httpx.AsyncClient(timeout=args.request_timeout) as client:
        info = (await client.get(f"{encoder_url}/server_info")).json()
        if not info.get("video"):
            return {"error": "the encoder's /server_info has no video: this model or build encodes no video"}
        sampling = within(VideoSampling.from_json(info["video"]["sampling"]), {"num_frames": args.encoder_frames})

        async def one(video: bytes) -> dict:
            t0 = time.perf_counter()
            response = await client.post(f"{encoder_url}/v1/encode",
                                         json=encode_body(random.getrandbits(ROOM_BITS), video, sampling.to_json()))
            wall = time.perf_counter() - t0
            if response.status_code != 200:
                raise RuntimeError(f"{encoder_url}/v1/encode: HTTP {response.status_code}: {response.text[:300]}")
            item = response.json()["images"][0]
            return {"status": item["status"], "num_tokens": item["num_tokens"], "seconds": item["seconds"],
                    "wall_s": round(wall, 4)}

        parts = {}
        for name, batch in (("batch_1", 1), (f"batch_{args.encoder_batch}", args.encoder_batch)):
            rounds = []
            before = await scrape(client, encoder_url)
            for _ in range(args.encoder_trials):
                videos = [make_video(next(seeds), *args.video_shape) for _ in range(batch)]
                await asyncio.sleep(args.gap_s)
                t0 = time.perf_counter()
                answers = await asyncio.gather(*(one(v) for v in videos))
                rounds.append({"wall_s": round(time.perf_counter() - t0, 4), "answers": answers})
            after = await scrape(client, encoder_url)
            parts[name] = {"batch": batch, "rounds": rounds,
                           "metrics": moved(before, after, lambda k: k.startswith("epd_encoder"))}
    return {"frames_per_video": sampling.num_frames,
            "sampling": sampling.to_json(), "parts": parts}


async def stream_trial(client, router: str, args, arrival: dict | None) -> dict:
    """One long stream (``stream_tokens`` tokens, ``ignore_eos``); with ``arrival`` (a video chat body),
    that request is sent once the stream has ``arrive_after`` tokens and timed on its own. The stream's
    token times (content chunks, from its send) and the video request's send, first token and end."""
    tokens: list[float] = []
    video: dict = {}
    task = None
    t0 = time.perf_counter()

    async def send_video() -> None:
        video["sent_s"] = time.perf_counter() - t0
        reply = await chat_stream.stream_chat(client, router, arrival, t0)
        video.update(ttft_s=reply.ttft_s, total_s=reply.total_s, prompt_tokens=reply.usage.get("prompt_tokens"))

    async with client.stream("POST", f"{router}/v1/chat/completions", json=stream_body(args.stream_tokens)) as response:
        if response.status_code != 200:
            await response.aread()
            raise RuntimeError(f"{router}: HTTP {response.status_code}: {response.text[:300]}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"{router}: in-band error {chunk['error']}")
            if any((c.get("delta") or {}).get("content") for c in chunk.get("choices") or []):
                tokens.append(time.perf_counter() - t0)
                if arrival is not None and task is None and len(tokens) >= args.arrive_after:
                    task = asyncio.create_task(send_video())
    if task is not None:
        await task
    return {"token_s": [round(t, 5) for t in tokens], "video": video or None}


def _cpu(pid: int | None) -> float | None:
    try:
        return cpu_seconds(pid) if pid is not None else None
    except OSError:
        return None


async def measure_tpot(router: str, args, seeds, stream_pid: int | None = None) -> list[dict]:
    """``tpot_trials`` rounds of trials, each a stream alone then a stream with a new video arriving
    beside it for each of ``tpot_frames`` (frame counts, the first the headline), ``gap_s`` idle before
    each; each trial's CPU seconds of ``stream_pid`` (the server decoding the stream: epd's decode,
    the colocated server) over it."""
    import httpx

    out = []
    async with httpx.AsyncClient(timeout=args.request_timeout) as client:
        for trial in range(args.tpot_trials):
            for frames in [None, *args.tpot_frames]:
                arrival = None
                if frames is not None:
                    arrival = chat_body(make_video(next(seeds), *args.video_shape), "Describe this video.",
                                        frames, args.max_tokens)
                await asyncio.sleep(args.gap_s)
                cpu0 = _cpu(stream_pid)
                result = await stream_trial(client, router, args, arrival)
                cpu1 = _cpu(stream_pid)
                out.append({"trial": trial, "with_video": frames is not None, "video_frames": frames, **result,
                            "stream_server_cpu_s": None if cpu0 is None or cpu1 is None else round(cpu1 - cpu0, 3)})
    return out
