"""The client of a phase: one timed request through the router (TTFT, text, every process's CPU ms
over it; for epd the encoder's and prefill's counters around it, the prefill's room events, the
images' landing), the TTFT sequence and the concurrent burst."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass

from bench.common import chat_stream
from bench.common.proc import cpu_seconds
from bench.epd_cache.analysis import wake
from bench.epd_cache.landing import LandingClock, created_at
from bench.epd_cache.workload import ImageSource, Pair, chat_body

ENCODED = "epd_encoder_images_encoded_total"
MISSES = "epd_cache_misses_total"


def metric(text: str, name: str) -> float:
    """The value of the unlabelled sample ``name`` in Prometheus text (0 when absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and not sample.labels:
                return sample.value
    return 0.0


async def scrape(client, url: str, name: str) -> float:
    response = await client.get(f"{url}/metrics")
    response.raise_for_status()
    return metric(response.text, name)


async def stream_chat(client, url: str, body: dict) -> dict:
    """POST a streaming chat request to the router; TTFT and the end (s), text, room and stage times."""
    reply = await chat_stream.stream_chat(client, url, body)
    return {"ttft_s": reply.ttft_s, "total_s": reply.total_s, "text": reply.text,
            "prompt_tokens": reply.usage.get("prompt_tokens"), "room": reply.room,
            "stage_times": dict((k, float(v)) for k, v in (e.split("=", 1) for e in
                                reply.headers.get("x-epd-stage-times", "").split(";") if "=" in e))}


@dataclass
class EpdProbe:
    """What an epd request is checked against: the encoder's and prefill's URLs, the Redis URL, the
    vision fingerprint (keys) and the landing clock."""

    encoder: str
    prefill: str
    redis_url: str
    fingerprint: str
    clock: LandingClock


def cpu_ms(pids: dict[str, int]) -> dict[str, float]:
    """CPU milliseconds (utime + stime, 10 ms ticks) of each process so far."""
    return {role: 1e3 * cpu_seconds(pid) for role, pid in pids.items()}


async def one_request(client, router: str, pair: Pair, case: str, args, probe: EpdProbe | None,
                      pids: dict[str, int]) -> dict:
    """One timed request of ``pair`` (``case`` miss or hit): TTFT, text, each process's CPU ms over
    the stream (``pids``); for epd, also the encoder's and the prefill's counters around it, the
    prefill's room events and the images' landing times."""
    body = chat_body(list(pair.pngs), args.max_tokens)
    tags = {"n": pair.n, "case": case, "round": pair.round, "index": pair.index, "warmup": pair.index < 0}
    if probe is None:
        cpu0 = cpu_ms(pids)
        reply = await stream_chat(client, router, body)
        return {**reply, **tags, "cpu_ms": {r: round(v - cpu0[r]) for r, v in cpu_ms(pids).items()}}
    from cache.keys import image_key

    keys = [image_key(p, probe.fingerprint) for p in pair.pngs]
    encoded0 = await scrape(client, probe.encoder, ENCODED)
    misses0 = await scrape(client, probe.prefill, MISSES)
    cpu0 = cpu_ms(pids)
    reply = await stream_chat(client, router, body)
    reply.update(tags, cpu_ms={r: round(v - cpu0[r]) for r, v in cpu_ms(pids).items()},
                 encoded=await scrape(client, probe.encoder, ENCODED) - encoded0,
                 prefill_cache_misses=await scrape(client, probe.prefill, MISSES) - misses0)
    room = await client.get(f"{probe.prefill}/rooms/{reply['room']}")
    events = {e["event"]: e["t"] for e in room.json()["events"]} if room.status_code == 200 else {}
    created = created_at(probe.redis_url, keys)
    reply["prefill_events"] = events
    reply["created_at"] = max(created.values()) if len(created) == len(keys) else None
    reply["landed_at"] = probe.clock.last_landing(keys) if case == "miss" else None
    reply.update(wake(reply, events))
    return reply


async def measure_ttft(router: str, pairs: list[Pair], args, probe: EpdProbe | None,
                       pids: dict[str, int]) -> list[dict]:
    """Every pair's miss then hit, one request at a time, ``gap_s`` idle before each."""
    import httpx

    samples = []
    async with httpx.AsyncClient(timeout=args.request_timeout) as client:
        for pair in pairs:
            for case in ("miss", "hit"):
                await asyncio.sleep(args.gap_s)
                samples.append(await one_request(client, router, pair, case, args, probe, pids))
    return samples


async def measure_burst(router: str, source: ImageSource, args, probe: EpdProbe) -> dict:
    """``burst_requests`` requests, ``burst_concurrency`` at a time, each with 1-4 images of a pool of
    ``burst_unique`` new images (image j%U in request j; the first C requests all hold the hot image 0):
    the encoder's calls per unique image, and every request's status."""
    import httpx

    rng = random.Random(args.seed)
    pool = source.take(args.burst_unique)
    requests = []
    for j in range(args.burst_requests):
        chosen = {j % len(pool)} | ({0} if j < args.burst_concurrency else set())
        chosen |= set(rng.sample(range(len(pool)), rng.randint(1, 4) - 1))
        requests.append([pool[i] for i in sorted(chosen)][:4])
    used = {p for r in requests for p in r}
    gate = asyncio.Semaphore(args.burst_concurrency)

    async def send(client, pngs: list[bytes]) -> int:
        async with gate:
            response = await client.post(f"{router}/v1/chat/completions", json=chat_body(pngs, 4, stream=False))
            return response.status_code

    async with httpx.AsyncClient(timeout=args.request_timeout) as client:
        encoded0 = await scrape(client, probe.encoder, ENCODED)
        started = time.perf_counter()
        statuses = await asyncio.gather(*(send(client, r) for r in requests))
        wall = time.perf_counter() - started
        encoded = await scrape(client, probe.encoder, ENCODED) - encoded0
    return {"requests": len(requests), "concurrency": args.burst_concurrency, "image_slots": sum(map(len, requests)),
            "unique_images": len(used), "encoded": encoded, "calls_per_unique_image": round(encoded / len(used), 4),
            "statuses": {str(s): statuses.count(s) for s in sorted(set(statuses))}, "wall_s": round(wall, 2)}
