"""The embedding cache of a 1E1P1D stack (encoder + prefill + decode behind the router, KV over
mooncake, a private Redis) against one colocated server behind the router, side by side in one run:
TTFT with the images cached and not, encoder calls per unique image, and the time from an
embedding landing in the cache to the waiting prefill starting.

    python bench/epd_cache.py                  # full run (~2-6 minutes on 2 cores, with the load)
    python bench/epd_cache.py --quick          # smoke run (~1-2 minutes)
    python bench/epd_cache.py --images 1,4,8 --image-size 448 --requests 6

Both systems are driven through the router (``stages.up.Stack``, what ``stage up`` starts), the
product's front door: in epd mode the router computes each image's key, asks the cache index which
are missing, claims them for the encoder and sends encoder, prefill and decode their parts at once.

Workload: each request is one user turn with N images (``--images``: 1, 4, 8) of
``--image-size`` pixels (224: 64 image tokens each) and a question; ``stream=true``,
``max_tokens=8``, ``temperature=0``, ``ignore_eos=true``. Every image is a distinct PNG (a
gradient, a square and the image's index written as pixels). Per round and N, ``--requests``
pairs: a *miss* (N images never sent before) then a *hit* (the same N images again), with
``--gap-s`` idle before each request; one untimed pair per N first. The colocated server (no cache)
gets the same bodies in the same order.

Measures:
- TTFT: send -> first SSE chunk with non-empty ``delta.content`` (the router's stream). Medians per
  system, N and case; the goal is epd hit <= 0.5x epd miss. Each request also records every
  server's CPU ms over its stream (``/proc``): the stage servers' sum is the steadier view of the
  work a hit saves when other load shares the cores.
- Encoder calls per unique image: the encoder's ``epd_encoder_images_encoded_total`` over the run /
  the distinct images sent. Over the TTFT requests (every miss image once, each then repeated) and a
  concurrent burst (``--burst-requests`` requests at ``--burst-concurrency``, each with 1-4 images
  from a pool of ``--burst-unique`` new ones, the first ``--burst-concurrency`` all holding one hot
  image). Goal: exactly 1.0. Each TTFT request also checks its own delta (N for a miss, 0 for a hit).
- Wake: for every miss whose prefill waited (its ``epd_cache_misses_total`` moved and it was paired
  before the last image landed), the prefill's ``embeddings_ready`` room event (``GET /rooms/{room}``:
  its room's inputs are in hand and the request goes to the engine next) minus the landing time of
  the request's last image. Landing = the kernel's receive stamp (``SO_TIMESTAMPNS``) of the image's
  ``ready`` event on this process's own subscriber socket (``LandingClock``): the event is the last
  step of the cache's write script, and on loopback the stamp is taken inside Redis's write of it,
  when it reaches every subscriber, the prefill included, however late this process reads it. Also
  reported: from the entry's ``created_at`` (the encoder's clock before it sends the write: an upper
  bound that includes the write's own trip). Wall clocks of one machine. Goal: p50 under 2 ms.
  (Rejected: Redis MONITOR dates the PUBLISH too but echoes every payload, which delayed the
  prefill's wake by ~10 ms; a subscriber's own read time is late by however long its thread waits
  for a core, up to several ms on this machine.)

Pinning (``--*-cores``): encoder core 0, prefill core 1, decode core 0; colocated core 1 (the
prefill's core: both run the forward pass of the first token there); router, Redis and this client
not pinned. Every thread of a process is pinned once it is healthy (``/proc/PID/task``), so threads
started later inherit it. Servers run ``--threads`` (1) torch threads. Phases run one after another
(colocated, then epd), the sequence ``--rounds`` times (2; 1 with ``--quick``), samples pooled.

Output: a table on stdout, ``bench/results/epd_cache.json`` and ``epd_cache.png``, and every
process's log under ``bench/results/epd_cache_<phase>_r<round>/``.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import random
import shutil
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(REPO))

from bench.common import (  # noqa: E402
    CpuMeter,
    add_model_args,
    add_output_args,
    cpu_seconds,
    loadavg,
    machine_info,
    make_image,
    make_parser,
    output_path,
    parse_cores,
    percentile,
    pin_this_process,
    pyplot,
    resolve_model,
    save_figure,
    write_json,
)

IMAGE_COUNTS = (1, 4, 8)
QUESTION = "Describe these pictures."
ROLES = {"epd": ("encoder", "prefill", "decode"), "colocated": ("colocated",)}
ENCODED = "epd_encoder_images_encoded_total"
MISSES = "epd_cache_misses_total"
WAKE_GOAL_MS = 2.0
HIT_GOAL = 0.5


# --- images and bodies -------------------------------------------------------------------------
def unique_png(index: int, size: int, salt: int) -> bytes:
    """A distinct PNG per (``index``, ``salt``): ``common.make_image`` with both numbers written as
    black/white pixels along the top row (the square alone repeats every 64 indices)."""
    image = make_image(index % 64, size)
    pixels = image.load()
    for bit in range(min(size, 64)):
        word = index if bit < 32 else salt
        on = (word >> (bit % 32)) & 1
        pixels[bit, 0] = (255, 255, 255) if on else (0, 0, 0)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def chat_body(pngs: list[bytes], max_tokens: int, stream: bool = True) -> dict:
    import base64

    content = [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(p).decode()}}
               for p in pngs]
    content.append({"type": "text", "text": QUESTION})
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


@dataclass(frozen=True)
class Pair:
    """One miss/hit pair of the TTFT workload: N images never sent before, then the same again."""

    n: int
    index: int  # per N: 0..requests-1 timed; -1 the warm-up
    round: int
    pngs: tuple[bytes, ...]


class ImageSource:
    """Hands out distinct PNGs, never the same one twice in a run."""

    def __init__(self, size: int, salt: int) -> None:
        self.size, self.salt, self.next_index = size, salt, 0

    def take(self, count: int) -> list[bytes]:
        out = [unique_png(self.next_index + i, self.size, self.salt) for i in range(count)]
        self.next_index += count
        return out


def plan_round(source: ImageSource, counts: list[int], requests: int, round_index: int) -> list[Pair]:
    """A round's pairs: the warm-up pair of each N, then ``requests`` pairs per N, Ns interleaved."""
    pairs = [Pair(n, -1, round_index, tuple(source.take(n))) for n in counts]
    for i in range(requests):
        pairs += [Pair(n, i, round_index, tuple(source.take(n))) for n in counts]
    return pairs


# --- processes ---------------------------------------------------------------------------------
def pin_all_threads(pid: int, cores: list[int]) -> None:
    """Pin every thread of ``pid`` to ``cores`` (threads started later inherit their parent's)."""
    if not cores:
        return
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), cores)
        except (ProcessLookupError, OSError):  # a thread that ended meanwhile
            continue


def start_stack(mode: str, args, model: Path, log_dir: Path, cores: dict[str, list[int]]):
    """A started, healthy ``Stack`` of ``mode`` behind the router, every process pinned; and its
    pinning record {role: {"pid", "cores"}}."""
    from stages.up import Stack, StackConfig

    config = StackConfig(model=model, log_dir=log_dir, mode=mode, transfer=args.transfer, threads=args.threads,
                         startup_timeout_s=args.startup_timeout, stage_args=("--log-level", "warning"))
    stack = Stack(config, say=lambda line: print(f"  [{mode}] {line}", flush=True)).start()
    pins = {}
    for child in stack.children:
        pin_all_threads(child.proc.pid, cores.get(child.spec.role, []))
        pins[child.spec.role] = {"pid": child.proc.pid, "cores": cores.get(child.spec.role) or None,
                                 "url": child.spec.url}
    if stack.redis is not None and stack.redis.process is not None:
        pin_all_threads(stack.redis.process.pid, cores.get("redis", []))
        pins["redis"] = {"pid": stack.redis.process.pid, "cores": cores.get("redis") or None, "url": stack.redis_url}
    return stack, pins


def parse_pushes(buffer: bytes) -> tuple[list[list[bytes]], int]:
    """The complete RESP2 arrays of bulk strings and integers at the start of ``buffer`` (what a
    subscribed connection receives: ``subscribe`` confirmations, ``message`` pushes), and how many
    bytes they took; an incomplete tail is left for the next read. Pure."""
    out, pos = [], 0
    while True:
        item, end = _parse_array(buffer, pos)
        if item is None:
            return out, pos
        out.append(item)
        pos = end


def _parse_array(buffer: bytes, pos: int) -> tuple[list[bytes] | None, int]:
    line_end = buffer.find(b"\r\n", pos)
    if line_end < 0:
        return None, pos
    if buffer[pos:pos + 1] != b"*":
        raise ValueError(f"not a RESP array at byte {pos}: {buffer[pos:pos + 40]!r}")
    items, cursor = [], line_end + 2
    for _ in range(int(buffer[pos + 1:line_end])):
        end = buffer.find(b"\r\n", cursor)
        if end < 0:
            return None, pos
        kind, value = buffer[cursor:cursor + 1], buffer[cursor + 1:end]
        if kind == b":":
            items.append(value)
            cursor = end + 2
        elif kind == b"$":
            start, size = end + 2, int(value)
            if len(buffer) < start + size + 2:
                return None, pos
            items.append(buffer[start:start + size])
            cursor = start + size + 2
        else:
            raise ValueError(f"unexpected RESP type {kind!r} at byte {cursor}")
    return items, cursor


class LandingClock:
    """When each image landed in the cache: the cache's write script ends by publishing the key's
    ``ready`` event, and this subscriber's socket asks the kernel to stamp every packet as it arrives
    (``SO_TIMESTAMPNS``, wall clock). On loopback the stamp is taken inside Redis's own ``write`` of
    the event, the moment it reaches every subscriber (the waiting prefill included); when this
    thread reads it later does not matter. A read that holds several events carries the last
    packet's stamp: only the last of them is dated (the others landed before it; counted in
    ``shared_stamps``)."""

    SO_TIMESTAMPNS = 35  # <asm-generic/socket.h>; the socket module does not name it

    def __init__(self, redis_url: str) -> None:
        import socket
        from urllib.parse import urlsplit

        from cache.scripts import CHANNEL

        url = urlsplit(redis_url)
        if url.scheme != "redis":
            raise ValueError(f"LandingClock needs a redis://HOST:PORT Redis, got {redis_url!r}")
        self.landed: dict[str, float | None] = {}  # every ready key heard -> its stamp, None if undated
        self.shared_stamps = 0
        self._buffer = b""
        self._closing = threading.Event()
        self._sock = socket.create_connection((url.hostname, url.port or 6379), timeout=10)
        self._sock.setsockopt(socket.SOL_SOCKET, self.SO_TIMESTAMPNS, 1)
        name = CHANNEL.encode()
        self._sock.sendall(b"*2\r\n$9\r\nSUBSCRIBE\r\n$%d\r\n%s\r\n" % (len(name), name))
        while not self._read_once():  # the confirmation: from here on every event reaches this socket
            pass
        self._sock.settimeout(0.2)
        self._thread = threading.Thread(target=self._run, name="landing-clock", daemon=True)
        self._thread.start()

    def _read_once(self) -> list[list[bytes]]:
        import struct

        data, ancillary, _, _ = self._sock.recvmsg(1 << 16, 64)
        if not data:
            raise ConnectionError("Redis closed the subscriber's connection")
        stamp = next((sec + nsec / 1e9 for level, kind, raw in ancillary if kind == self.SO_TIMESTAMPNS
                      for sec, nsec in [struct.unpack("qq", raw[:16])]), None)
        pushes, used = parse_pushes(self._buffer + data)
        self._buffer = (self._buffer + data)[used:]
        events = [json.loads(p[2]) for p in pushes if p[0] == b"message"]
        ready = [e["key"] for e in events if e.get("kind") == "ready"]
        for key in ready[:-1]:
            self.landed.setdefault(key, None)
        if ready:
            self.landed.setdefault(ready[-1], stamp)
            self.shared_stamps += len(ready) - 1
        return pushes

    def last_landing(self, keys: list[str], timeout_s: float = 2.0) -> float | None:
        """When the last of ``keys`` landed: the latest stamp among them, once every key's event has
        been read (within ``timeout_s``; None if not, or if none of them is dated). Keys are heard in
        the order they land, and an undated one landed before a dated one read with it, so the latest
        stamp is the last landing as long as ``keys`` are one request's, one request at a time."""
        deadline = time.monotonic() + timeout_s
        while any(k not in self.landed for k in keys):
            if time.monotonic() > deadline:
                return None
            time.sleep(0.01)
        stamps = [self.landed[k] for k in keys if self.landed[k] is not None]
        return max(stamps) if stamps else None

    def _run(self) -> None:
        while not self._closing.is_set():
            try:
                self._read_once()
            except TimeoutError:
                continue
            except OSError:  # Redis stopped, or close()
                return

    def close(self) -> None:
        self._closing.set()
        self._thread.join(5)
        self._sock.close()


def created_at(redis_url: str, keys: list[str]) -> dict[str, float]:
    """The cache entry's ``created_at`` of each key still cached."""
    import redis

    from cache.entry import decode_entry
    from cache.scripts import entry_key

    client = redis.Redis.from_url(redis_url, socket_timeout=5)
    try:
        out = {}
        for key in keys:
            meta = client.hget(entry_key(key), "meta")
            if meta is not None:
                out[key] = decode_entry(meta).created_at
        return out
    finally:
        client.close()


# --- client ------------------------------------------------------------------------------------
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
    first_content = None
    pieces: list[str] = []
    usage = None
    t0 = time.perf_counter()
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            raise RuntimeError(f"{url}: HTTP {response.status_code}: {response.text[:500]}")
        headers = response.headers
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"{url}: in-band error {chunk['error']}")
            for choice in chunk.get("choices") or []:
                text = (choice.get("delta") or {}).get("content")
                if text:
                    pieces.append(text)
                    if first_content is None:
                        first_content = time.perf_counter() - t0
            usage = chunk.get("usage") or usage
    if first_content is None:
        raise RuntimeError(f"{url}: the stream carried no content")
    room = headers.get("x-epd-room")
    return {"ttft_s": first_content, "total_s": time.perf_counter() - t0, "text": "".join(pieces),
            "prompt_tokens": (usage or {}).get("prompt_tokens"), "room": int(room) if room else None,
            "stage_times": dict((k, float(v)) for k, v in (e.split("=", 1) for e in
                                headers.get("x-epd-stage-times", "").split(";") if "=" in e))}


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
    reply.update(_wake(reply, events))
    return reply


def _wake(reply: dict, events: dict[str, float]) -> dict:
    """The miss's wake figures: did the prefill wait for the last image (its cache misses moved, and it
    was queued and paired before that image landed), and from its landing (``wake_ms``) and from its
    entry's ``created_at`` (the encoder's clock before it sent the write: an upper bound;
    ``wake_upper_ms``) to ``embeddings_ready``, in ms."""
    ready, landed = events.get("embeddings_ready"), reply["landed_at"] or reply["created_at"]
    if reply["case"] != "miss" or ready is None or landed is None:
        return {"waited": False}
    waited = reply["prefill_cache_misses"] > 0 and events.get("queued", 1e18) <= landed \
        and events.get("paired", 1e18) <= landed
    out = {"waited": waited, "wake_upper_ms": round(1e3 * (ready - reply["created_at"]), 3),
           "paired_before_landing_ms": round(1e3 * (landed - events.get("paired", landed)), 3)}
    if reply["landed_at"] is not None:
        out["wake_ms"] = round(1e3 * (ready - reply["landed_at"]), 3)
    return out


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


# --- one phase ---------------------------------------------------------------------------------
def run_phase(mode: str, args, model: Path, pairs: list[Pair], source: ImageSource, out: Path,
              round_index: int, cores: dict[str, list[int]]) -> dict:
    """Start the mode's stack, measure, stop it."""
    import httpx

    log_dir = out.with_name(f"{out.stem}_{mode}_r{round_index}")
    shutil.rmtree(log_dir, ignore_errors=True)  # Stack appends to its logs; keep only this run's
    started = time.perf_counter()
    stack, pins = start_stack(mode, args, model, log_dir.resolve(), cores)
    clock = None
    try:
        startup_s = time.perf_counter() - started
        print(f"[{mode} r{round_index}] " + ", ".join(f"{r} pid {p['pid']} on cores {p['cores'] or 'any'}"
                                                     for r, p in pins.items())
              + f"; healthy after {startup_s:.1f} s; load {loadavg()}", flush=True)
        probe, clock = None, None
        if mode == "epd":
            urls = stack.urls()
            fingerprint = httpx.get(f"{urls['encoder']}/server_info", timeout=10).json()["vision_fingerprint"]
            clock = LandingClock(urls["redis"])
            probe = EpdProbe(urls["encoder"], urls["prefill"], urls["redis"], fingerprint, clock)
        cpu0 = {r: cpu_seconds(p["pid"]) for r, p in pins.items()}
        meter = CpuMeter({os.getpid(), *(p["pid"] for p in pins.values())}, cpu_key="client_cpu_s")
        samples = asyncio.run(measure_ttft(stack.url, pairs, args, probe, {r: p["pid"] for r, p in pins.items()}))
        burst = asyncio.run(measure_burst(stack.url, source, args, probe)) if probe is not None else None
        usage = meter.done()
        usage["server_cpu_s"] = {r: round(cpu_seconds(p["pid"]) - cpu0[r], 2) for r, p in pins.items()}
    finally:
        if clock is not None:
            clock.close()
        stack.stop()
    return {"phase": mode, "round": round_index, "startup_s": round(startup_s, 1), "pinning": pins,
            "measure": usage, "samples": samples, "burst": burst, "logs": str(log_dir),
            "landings_sharing_a_stamp": clock.shared_stamps if clock is not None else None}


# --- statistics --------------------------------------------------------------------------------
def _stats(values: list[float]) -> dict:
    """n, median, p90, min and max of ``values`` (2 decimals); {"n": 0} for none."""
    if not values:
        return {"n": 0}
    return {"n": len(values), "median": round(statistics.median(values), 2), "p90": round(percentile(values, 0.9), 2),
            "min": round(min(values), 2), "max": round(max(values), 2)}


def summarize(runs: dict[str, list[dict]], counts: list[int]) -> dict:
    """Per system, N and case: TTFT stats (ms), the stage servers' CPU ms per request (median of their
    sum, and per process: router and Redis apart), prompt tokens; epd: encoder and wake figures."""
    out: dict = {"ttft_ms": {}, "cpu_ms": {}, "prompt_tokens": {}}
    for mode, mode_runs in runs.items():
        timed = [s for run in mode_runs for s in run["samples"] if not s["warmup"]]
        for n in counts:
            for case in ("miss", "hit"):
                mine = [s for s in timed if s["n"] == n and s["case"] == case]
                out["ttft_ms"].setdefault(mode, {}).setdefault(str(n), {})[case] = _stats([1e3 * s["ttft_s"] for s in mine])
                out["cpu_ms"].setdefault(mode, {}).setdefault(str(n), {})[case] = {
                    "stages_median": statistics.median(sum(s["cpu_ms"][r] for r in ROLES[mode]) for s in mine),
                    **{r: statistics.median(s["cpu_ms"][r] for s in mine) for r in mine[0]["cpu_ms"]}} if mine else {}
            out["prompt_tokens"][str(n)] = next((s["prompt_tokens"] for s in timed if s["n"] == n), None)
    epd = [s for run in runs.get("epd", []) for s in run["samples"]]
    if epd:
        out.update(_epd_summary(runs, epd, counts))
        cpu = out["cpu_ms"]["epd"]
        out["ratio_hit_vs_miss_cpu"] = {str(n): round(cpu[str(n)]["hit"]["stages_median"]
                                                      / cpu[str(n)]["miss"]["stages_median"], 3) for n in counts}
    return out


def _epd_summary(runs: dict[str, list[dict]], epd: list[dict], counts: list[int]) -> dict:
    timed = [s for s in epd if not s["warmup"]]
    ttft = {n: {c: statistics.median(1e3 * s["ttft_s"] for s in timed if s["n"] == n and s["case"] == c)
                for c in ("miss", "hit")} for n in counts}
    ratios = {str(n): round(ttft[n]["hit"] / ttft[n]["miss"], 3) for n in counts}
    # each hit against its own miss, sent 0.25 s before it: outside load drifting over a run cancels
    misses = {(s["round"], s["n"], s["index"]): s["ttft_s"] for s in timed if s["case"] == "miss"}
    paired = {str(n): _stats([s["ttft_s"] / misses[(s["round"], n, s["index"])] for s in timed
                           if s["n"] == n and s["case"] == "hit"]) for n in counts}
    coloc = [s for run in runs.get("colocated", []) for s in run["samples"] if not s["warmup"]]
    vs_coloc = {}
    if coloc:
        for n in counts:
            base = statistics.median(1e3 * s["ttft_s"] for s in coloc if s["n"] == n)
            vs_coloc[str(n)] = {c: round(ttft[n][c] / base, 3) for c in ("miss", "hit")}
    # encoder calls: over the TTFT workload (each miss image once; hits must add nothing), and the bursts
    ttft_unique = sum(s["n"] for s in epd if s["case"] == "miss")
    ttft_encoded = sum(s["encoded"] for s in epd)
    bursts = [run["burst"] for run in runs["epd"] if run["burst"]]
    burst_unique = sum(b["unique_images"] for b in bursts)
    burst_encoded = sum(b["encoded"] for b in bursts)
    wrong = [{"n": s["n"], "case": s["case"], "room": s["room"], "encoded": s["encoded"]} for s in epd
             if s["encoded"] != (s["n"] if s["case"] == "miss" else 0)]
    waited = [s for s in epd if s["case"] == "miss" and s.get("waited")]
    wake = {"all": _stats([s["wake_ms"] for s in waited if "wake_ms" in s]),
            "upper_bound": _stats([s["wake_upper_ms"] for s in waited]),
            "per_n": {str(n): _stats([s["wake_ms"] for s in waited if s["n"] == n and "wake_ms" in s]) for n in counts},
            "upper_bound_per_n": {str(n): _stats([s["wake_upper_ms"] for s in waited if s["n"] == n]) for n in counts},
            "misses": sum(1 for s in epd if s["case"] == "miss"), "waited": len(waited),
            "not_waited": [{"n": s["n"], "room": s["room"], "prefill_cache_misses": s["prefill_cache_misses"],
                            "paired_before_landing_ms": s.get("paired_before_landing_ms")}
                           for s in epd if s["case"] == "miss" and not s.get("waited")]}
    hit_read = [1e3 * (s["prefill_events"]["embeddings_ready"] - s["prefill_events"]["paired"])
                for s in epd if s["case"] == "hit" and {"paired", "embeddings_ready"} <= s["prefill_events"].keys()]
    return {
        "ratio_hit_vs_miss": ratios,
        "ratio_hit_vs_miss_paired": paired,
        "ratio_epd_vs_colocated": vs_coloc,
        "encoder_calls": {
            "ttft_workload": {"unique_images": ttft_unique, "encoded": ttft_encoded,
                              "calls_per_unique_image": round(ttft_encoded / ttft_unique, 4) if ttft_unique else None},
            "burst": {"unique_images": burst_unique, "encoded": burst_encoded,
                      "calls_per_unique_image": round(burst_encoded / burst_unique, 4) if burst_unique else None,
                      "runs": bursts},
            "overall_calls_per_unique_image": round((ttft_encoded + burst_encoded) / (ttft_unique + burst_unique), 4),
            "requests_with_a_wrong_count": wrong},
        "wake_ms": wake,
        "hit_paired_to_embeddings_ready_ms": _stats(hit_read),
    }


def same_texts(runs: dict[str, list[dict]]) -> dict:
    """Whether epd answered each body with the colocated server's text (greedy: identical expected)."""
    if not runs.get("colocated") or not runs.get("epd"):
        return {}
    coloc = [s for run in runs["colocated"] for s in run["samples"]]
    epd = [s for run in runs["epd"] for s in run["samples"]]
    pairs = list(zip(coloc, epd, strict=True))  # the same bodies in the same order
    differ = [{"round": c["round"], "n": c["n"], "case": c["case"]} for c, e in pairs if c["text"] != e["text"]]
    return {"compared": len(pairs), "differ": differ}


# --- report ------------------------------------------------------------------------------------
def print_table(summary: dict, counts: list[int]) -> None:
    ttft, ratios = summary["ttft_ms"], summary.get("ratio_hit_vs_miss", {})
    print()
    header = (f"{'images':>6}{'prompt':>8}  {'system':<10}{'case':<6}{'TTFT p50':>9}{'p90':>9}{'min':>9}{'n':>4}"
              f"{'hit/miss':>10}{'paired':>8}{'/coloc':>8}{'CPU ms':>8}{'hit/miss':>10}")
    print(header)
    print("-" * len(header))
    for n in counts:
        first = True
        for mode in ttft:
            for case in ("miss", "hit"):
                s = ttft[mode][str(n)][case]
                if not s["n"]:
                    continue
                ratio = f"{ratios[str(n)]:.2f}x" if mode == "epd" and case == "hit" and str(n) in ratios else ""
                paired = f"{summary['ratio_hit_vs_miss_paired'][str(n)]['median']:.2f}x" if ratio else ""
                coloc = summary.get("ratio_epd_vs_colocated", {}).get(str(n), {}).get(case) if mode == "epd" else None
                lead = f"{n:>6}{summary['prompt_tokens'][str(n)] or 0:>8}" if first else " " * 14
                first = False
                cpu = summary["cpu_ms"][mode][str(n)]
                cpu_ratio = f"{cpu['hit']['stages_median'] / cpu['miss']['stages_median']:.2f}x" \
                    if mode == "epd" and case == "hit" and cpu["miss"]["stages_median"] else ""
                print(f"{lead}  {mode:<10}{case:<6}{s['median']:>9.1f}{s['p90']:>9.1f}{s['min']:>9.1f}{s['n']:>4}"
                      f"{ratio:>10}{paired:>8}{f'{coloc:.2f}x' if coloc else '':>8}{cpu[case]['stages_median']:>8.0f}"
                      f"{cpu_ratio:>10}")
        print()
    print("TTFT in ms: send -> first SSE chunk with content, through the router. colocated has no cache: its")
    print("'hit' is the same body computed again. hit/miss: ratio of the epd medians (goal <= 0.5); paired: median")
    print("of each hit's TTFT over its own miss's (sent 0.25 s apart: less moved by drifting outside load). CPU ms: the")
    print("stage servers' CPU per request (median of E+P+D, or colocated; /proc, 10 ms ticks), steadier than TTFT")
    print("when other work shares the cores.")
    if "encoder_calls" in summary:
        e, w = summary["encoder_calls"], summary["wake_ms"]
        print(f"encoder calls per unique image: TTFT workload {e['ttft_workload']['calls_per_unique_image']} "
              f"({e['ttft_workload']['encoded']:g} encodes / {e['ttft_workload']['unique_images']} images), burst "
              f"{e['burst']['calls_per_unique_image']} ({e['burst']['encoded']:g} / {e['burst']['unique_images']}), "
              f"overall {e['overall_calls_per_unique_image']} (goal 1.0); requests with a wrong count: "
              f"{len(e['requests_with_a_wrong_count'])}")
        print(f"misses whose prefill waited for its last image: {w['waited']} of {w['misses']}")
        for name, a in (("landing", w["all"]), ("created_at (upper bound)", w["upper_bound"])):
            if a["n"]:
                print(f"{name} -> waiting prefill starts: p50 {a['median']:.2f} ms, p90 {a['p90']:.2f}, "
                      f"min {a['min']:.2f}, max {a['max']:.2f} (goal p50 < {WAKE_GOAL_MS:g} ms)")
        h = summary["hit_paired_to_embeddings_ready_ms"]
        print(f"hits, paired -> embeddings_ready (the cached entries read and checked): p50 {h['median']:.2f} ms")


def plot(summary: dict, runs: dict[str, list[dict]], counts: list[int], path: Path, title: str) -> None:
    """TTFT bars per N (epd miss, epd hit, colocated), the wake CDF, encoder calls per unique image."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.4), gridspec_kw={"width_ratios": [2.2, 1.4, 1]})
    ax = axes[0]
    bars = [("epd", "miss", "tab:red"), ("epd", "hit", "tab:green"), ("colocated", "miss", "grey"),
            ("colocated", "hit", "silver")]
    bars = [b for b in bars if b[0] in summary["ttft_ms"]]
    width = 0.8 / len(bars)
    for j, (mode, case, color) in enumerate(bars):
        for i, n in enumerate(counts):
            s = summary["ttft_ms"][mode][str(n)][case]
            if not s["n"]:
                continue
            x = i + (j - (len(bars) - 1) / 2) * width
            ax.bar(x, s["median"], width, yerr=[[0], [s["p90"] - s["median"]]], capsize=2, color=color,
                   label=f"{mode} {case if mode == 'epd' else ('(same body)' if case == 'miss' else '(again)')}"
                   if i == 0 else None)
            label = f"{s['median']:.0f}"
            if mode == "epd" and case == "hit":
                label += f"\n{summary['ratio_hit_vs_miss'][str(n)]:.2f}x"
            ax.text(x, s["median"], label, ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(counts)), [f"{n} image{'s' if n > 1 else ''}\n({summary['prompt_tokens'][str(n)]} tok)"
                                       for n in counts], fontsize=8)
    ax.set_ylabel("TTFT ms (median, bar to p90)")
    ax.set_title("TTFT: cached (hit) vs not (miss); label: hit/miss", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(axis="y", alpha=0.3)
    ax = axes[1]
    waited = [s for run in runs.get("epd", []) for s in run["samples"] if s.get("waited")]
    exact = sorted(s["wake_ms"] for s in waited if "wake_ms" in s)
    upper = sorted(s["wake_upper_ms"] for s in waited)
    for values, label, color in ((exact, "from landing", "tab:blue"),
                                 (upper, "from created_at (upper bound)", "tab:cyan")):
        if values:
            ax.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post", label=label, color=color)
    ax.axvline(WAKE_GOAL_MS, color="red", linestyle="--", label=f"goal p50 {WAKE_GOAL_MS:g} ms")
    ax.axhline(0.5, color="grey", linewidth=0.5)
    ax.set_xlabel("embedding landed -> prefill starts (ms)")
    ax.set_ylabel("fraction of misses that waited")
    ax.set_title("wake latency (CDF)", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    ax = axes[2]
    if "encoder_calls" in summary:
        e = summary["encoder_calls"]
        names = ["TTFT\nworkload", "concurrent\nburst", "overall"]
        values = [e["ttft_workload"]["calls_per_unique_image"], e["burst"]["calls_per_unique_image"],
                  e["overall_calls_per_unique_image"]]
        ax.bar(range(3), [v or 0 for v in values], 0.6, color="tab:purple")
        for i, v in enumerate(values):
            ax.text(i, (v or 0), f"{v}", ha="center", va="bottom", fontsize=8)
        ax.axhline(1.0, color="red", linestyle="--", label="goal 1.0")
        ax.set_xticks(range(3), names, fontsize=8)
        ax.set_ylim(0, max(1.5, max(v or 0 for v in values) * 1.2))
        ax.legend(fontsize=7)
    ax.set_title("encoder calls per unique image", fontsize=9)
    fig.suptitle(title, fontsize=9)
    save_figure(fig, path)


# --- main --------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = make_parser(__doc__)
    add_model_args(p)
    p.add_argument("--transfer", default="mooncake", help="KV transfer of the epd stack")
    p.add_argument("--no-colocated", action="store_true", help="skip the colocated phase")
    p.add_argument("--images", default=",".join(map(str, IMAGE_COUNTS)), help="images per request (comma-separated)")
    p.add_argument("--image-size", type=int, default=224, help="width and height of every image (pixels)")
    p.add_argument("--requests", type=int, default=4, help="timed miss/hit pairs per image count, phase and round")
    p.add_argument("--rounds", type=int, default=2, help="run the sequence of phases this many times (pooled)")
    p.add_argument("--max-tokens", type=int, default=8, help="tokens generated per request")
    p.add_argument("--gap-s", type=float, default=0.25, help="idle time before each request")
    p.add_argument("--burst-requests", type=int, default=32, help="requests of the concurrent burst (epd, per round)")
    p.add_argument("--burst-concurrency", type=int, default=8, help="requests in flight in the burst")
    p.add_argument("--burst-unique", type=int, default=12, help="distinct images the burst's requests draw from")
    p.add_argument("--seed", type=int, default=0, help="the burst's image choice")
    p.add_argument("--threads", type=int, default=1, help="torch threads of every stage server")
    p.add_argument("--encoder-cores", default="0", help="cores of the encoder ('' : not pinned)")
    p.add_argument("--prefill-cores", default="1", help="cores of the prefill")
    p.add_argument("--decode-cores", default="0", help="cores of the decode")
    p.add_argument("--colocated-cores", default="1", help="cores of the colocated server")
    p.add_argument("--router-cores", default="", help="cores of the router ('' : not pinned)")
    p.add_argument("--redis-cores", default="", help="cores of the embedded Redis ('' : not pinned)")
    p.add_argument("--client-cores", default="", help="cores of this process, the client ('' : not pinned)")
    p.add_argument("--startup-timeout", type=float, default=300.0, help="seconds for a stack to be healthy")
    p.add_argument("--request-timeout", type=float, default=120.0, help="seconds per request")
    add_output_args(p, "epd_cache", quick_help="smoke run: 2 pairs per image count, 1 round, a 16-request burst")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.requests, args.rounds, args.burst_requests = min(args.requests, 2), 1, min(args.burst_requests, 16)
    counts = [int(n) for n in args.images.split(",") if n.strip()]
    cores = {role: parse_cores(getattr(args, f"{role}_cores"))
             for role in ("encoder", "prefill", "decode", "colocated", "router", "redis")}
    client_cores = pin_this_process(args.client_cores)
    out = output_path(args)
    started = time.time()
    model = resolve_model(args)
    info = machine_info()
    print(f"model {model}; client pid {os.getpid()} on cores {client_cores or 'any'}; load {loadavg()}", flush=True)
    source = ImageSource(args.image_size, random.getrandbits(32))
    modes = ([] if args.no_colocated else ["colocated"]) + ["epd"]
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for round_index in range(1, args.rounds + 1):
        pairs = plan_round(source, counts, args.requests, round_index)  # the same bodies for every system
        for mode in modes:
            print(f"--- round {round_index}/{args.rounds}: {mode}", flush=True)
            runs[mode].append(run_phase(mode, args, model, pairs, source, out, round_index, cores))
            _print_phase(runs[mode][-1], counts)
    summary = summarize(runs, counts)
    summary["same_text_as_colocated"] = same_texts(runs)
    report = {
        "benchmark": "epd_cache",
        "machine": info,
        "pinning": {**{role: c or None for role, c in cores.items()},
                    "client": {"pid": os.getpid(), "cores": client_cores or None}, "torch_threads": args.threads,
                    "note": "every thread of a process pinned once healthy; pids per phase under runs[].pinning"},
        "config": {"family": args.family, "size": args.size, "model_dir": str(model), "images": counts,
                   "image_size": args.image_size, "requests": args.requests, "rounds": args.rounds,
                   "max_tokens": args.max_tokens, "gap_s": args.gap_s, "transfer": args.transfer,
                   "burst": {"requests": args.burst_requests, "concurrency": args.burst_concurrency,
                             "unique": args.burst_unique}, "quick": args.quick, "driven_through": "router",
                   "ttft": "send -> first SSE chunk with non-empty delta content, through the router",
                   "wake": "prefill room event embeddings_ready - the last image's landing: the kernel's receive "
                           "stamp of its ready event on a subscriber socket (upper bound: - its entry's "
                           "created_at); misses whose prefill waited"},
        "summary": summary,
        "goals": _goals(summary),
        "runs": runs,
        "total_s": round(time.time() - started, 1),
    }
    write_json(out, report)
    png = out.with_suffix(".png")
    plot(summary, runs, counts, png, f"epd cache, {args.family}-{args.size}, {args.image_size}px images, 1 request at "
                                     f"a time via the router; E core {args.encoder_cores}, P core {args.prefill_cores}"
                                     f", D core {args.decode_cores}, colocated core {args.colocated_cores}")
    print_table(summary, counts)
    print(f"goals: {json.dumps(report['goals'])}")
    print(f"wrote {out} and {png} ({report['total_s']} s)")
    return 0


def _goals(summary: dict) -> dict:
    if "ratio_hit_vs_miss" not in summary:
        return {}
    wake = summary["wake_ms"]["all"] if summary["wake_ms"]["all"]["n"] else summary["wake_ms"]["upper_bound"]
    return {"hit_le_half_miss": {n: r <= HIT_GOAL for n, r in summary["ratio_hit_vs_miss"].items()},
            "hit_le_half_miss_paired": {n: r["median"] <= HIT_GOAL
                                        for n, r in summary["ratio_hit_vs_miss_paired"].items()},
            "one_encode_per_unique_image": summary["encoder_calls"]["overall_calls_per_unique_image"] == 1.0,
            "wake_p50_under_2ms": wake["n"] > 0 and wake["median"] < WAKE_GOAL_MS}


def _print_phase(run: dict, counts: list[int]) -> None:
    timed = [s for s in run["samples"] if not s["warmup"]]
    for n in counts:
        parts = []
        for case in ("miss", "hit"):
            ttft = [1e3 * s["ttft_s"] for s in timed if s["n"] == n and s["case"] == case]
            if ttft:
                parts.append(f"{case} {statistics.median(ttft):.1f} ms")
        print(f"[{run['phase']} r{run['round']}] {n} images: TTFT median " + ", ".join(parts), flush=True)
    if run["burst"]:
        b = run["burst"]
        print(f"[{run['phase']} r{run['round']}] burst: {b['encoded']:g} encodes for {b['unique_images']} unique images "
              f"in {b['requests']} requests at c={b['concurrency']}, statuses {b['statuses']}", flush=True)
    m = run["measure"]
    print(f"[{run['phase']} r{run['round']}] load {m['loadavg_1m']}, core busy {m['core_busy_fraction']}, "
          f"server CPU s {m['server_cpu_s']}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
