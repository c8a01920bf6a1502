"""What the rig's fault tests (``tests/multihost/test_faults_*.py``) share.

``start_default_stack(rig, encoders)``  the stack of ``tests/multihost/stack.py`` (Redis with a
    password, every stage on its own host, Mooncake) with **default deadline flags everywhere**: only
    the rig's address flags, ``--allowed-bootstrap``, ``--group``, a KV pool size, and round-robin P and
    D policies on the router (``start_stack`` also shortens the router's health interval; this does not).
Everything else runs on a client-host thread (``rig.client``/``rig.client_async``): ``info``,
``blocks_used``, ``claims``, ``router_metric``, ``wait_until``, ``chat`` (one request through the
official client, stream or not, timed, ending in its text or its ``openai.APIError``), ``frozen``
(SIGSTOP then SIGCONT of a server's process: the moment a cut lands, chosen by the test).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass

import httpx
import openai
import redis

from cache import scripts
from cache.keys import image_key
from router.plan.policy import CacheAware
from tests.support.generated_models import model_dir
from tests.multihost.rig import BOOTSTRAP_PORT, Rig, Server
from tests.multihost.stack import ADMIN_TOKEN, STAGE_FLAGS, VARIANT, Stack
from tests.support.process_stop import stopped as process_stopped
from tests.support.router_helpers import data_url, messages, png

DEADLINE_S = 10.0  # issue 16: every request ends within this, with default flags
READMIT_S = 30.0  # a restored stage is back in rotation within this
CONCURRENT = 8


def start_default_stack(rig: Rig, encoders: tuple[str, ...] = ("e1", "e2"), transfer: str = "mooncake") -> Stack:
    """Redis, ``encoders``, p1, p2, d1, d2 and the router, every deadline flag at its default."""
    rig.start_redis()
    model = ("--model", str(model_dir(VARIANT)))
    prefills, decodes = ("p1", "p2"), ("d1", "d2")
    allowed = ",".join(rig.hostport(p, BOOTSTRAP_PORT) for p in prefills)
    jobs = [(h, "encoder", *model) for h in encoders]
    jobs += [(h, "prefill", *model, *STAGE_FLAGS, "--transfer", transfer, "--group", h) for h in prefills]
    jobs += [(h, "decode", *model, *STAGE_FLAGS, "--transfer", transfer, "--group", h,
              "--allowed-bootstrap", allowed) for h in decodes]
    found = iter(rig.start_all(jobs))
    e, p, d = ([next(found) for _ in hosts] for hosts in (encoders, prefills, decodes))
    workers = [flag for role, group in (("--encoder", e), ("--prefill", p), ("--decode", d))
               for server in group for flag in (role, server.url)]
    router = rig.start("router", "router", *workers, "--policy-prefill", "round_robin", "--policy-decode",
                       "round_robin", "--admin-token", ADMIN_TOKEN)
    return Stack(rig, transfer, e, p, d, router)


# --- on a client-host thread ---------------------------------------------------------------------
def info(server: Server) -> dict:
    return httpx.get(f"{server.url}/server_info", timeout=5).json()


def blocks_used(servers: list[Server]) -> list[int]:
    return [info(s)["kv_blocks"]["used"] for s in servers]


def claims(rig: Rig) -> list[bytes]:
    """The image claims in Redis now (``epd:claim:*``)."""
    with redis.Redis.from_url(rig.redis_url, socket_timeout=2, socket_connect_timeout=2) as db:
        return list(db.scan_iter(match=scripts.claim_key("*")))


def router_metric(router: Server, name: str) -> float:
    for line in httpx.get(f"{router.url}/metrics", timeout=5).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not in {router.url}/metrics")


def retries(router: Server, stage: str) -> float:
    """Requests the router retried on fresh workers because ``stage`` failed."""
    return router_metric(router, f'epd_router_retries_total{{stage="{stage}"}}')


def worker_metric(router: Server, metric: str, role: str, worker: Server) -> float:
    return router_metric(router, f'{metric}{{role="{role}",worker="{worker.url}"}}')


def in_rotation(router: Server, role: str, worker: Server) -> bool:
    """The router would send ``worker`` a request: its last health check passed and its breaker is
    not open (closed, or half-open: the next request is its trial)."""
    return (worker_metric(router, "epd_router_worker_healthy", role, worker) == 1.0
            and worker_metric(router, "epd_router_circuit_state", role, worker) != 2.0)


def wait_until(check: Callable[[], bool], within_s: float, what: str) -> float:
    """Poll ``check`` until true; fail naming ``what`` after ``within_s``. Returns the seconds it took."""
    started = time.monotonic()
    while not check():
        assert time.monotonic() - started < within_s, f"not within {within_s:g} s: {what}"
        time.sleep(0.05)
    return time.monotonic() - started


@dataclass
class Answer:
    seconds: float  # from the call to its text or its error
    text: str | None
    error: openai.APIError | None
    ended_at: float = 0.0  # time.monotonic() when it ended

    @property
    def message(self) -> str:
        return str(self.error.message) if self.error is not None else ""

    @property
    def status(self) -> int | None:
        return getattr(self.error, "status_code", None)


@asynccontextmanager
async def client_of(stack: Stack) -> AsyncIterator[tuple[openai.AsyncOpenAI, str]]:
    """An OpenAI client of the router and its model, closed on leaving: an unclosed client schedules
    its close on whichever event loop runs when it is collected, a later test's."""
    model = httpx.get(f"{stack.router.url}/v1/models", timeout=5).json()["data"][0]["id"]
    async with openai.AsyncOpenAI(base_url=stack.router.base_url, api_key="x", max_retries=0, timeout=60) as client:
        yield client, model


async def chat(client: openai.AsyncOpenAI, model: str, text: str, images: list[bytes] = (), *, stream: bool = True,
               max_tokens: int = 8, ignore_eos: bool = False, first: asyncio.Event | None = None) -> Answer:
    """One greedy chat request; its text, or the error it ended with (HTTP status or in-band). A
    stream sets ``first`` once its first chunk with text has reached the client."""
    started = time.monotonic()

    def done(text: str | None, error: openai.APIError | None = None) -> Answer:
        now = time.monotonic()
        return Answer(now - started, text, error, now)

    kwargs = dict(model=model, messages=messages(text, [data_url(b) for b in images]), max_tokens=max_tokens,
                  temperature=0, extra_body={"ignore_eos": ignore_eos})
    try:
        if not stream:
            reply = await client.chat.completions.create(**kwargs)
            return done(reply.choices[0].message.content or "")
        out = ""
        async for chunk in await client.chat.completions.create(**kwargs, stream=True):
            if chunk.choices and chunk.choices[0].delta.content:
                out += chunk.choices[0].delta.content
                if first is not None:
                    first.set()
        return done(out)
    except openai.APIError as error:
        return done(None, error)


def assert_ok_or_naming(answers: list[Answer], stage: str, victim: Server, within_s: float = DEADLINE_S) -> None:
    """Every answer came within ``within_s``: a non-empty text, or an OpenAI-style error whose message
    names ``stage`` and ``victim``'s URL."""
    for answer in answers:
        assert answer.seconds < within_s, (answer.seconds, answer.text, answer.message)
        if answer.error is None:
            assert answer.text, answer
        else:
            assert stage in answer.message and victim.url in answer.message, (answer.status, answer.message)


@contextmanager
def frozen(server: Server) -> Iterator[None]:
    """``server``'s process stopped (SIGSTOP) for the block: a test picks the moment a cut lands."""
    with process_stopped(server.proc.pid):
        yield


# --- images -------------------------------------------------------------------------------------
@dataclass
class _Named:
    name: str
    outstanding: int = 0


def images_for(stack: Stack, encoder: Server, seed: int, count: int) -> list[bytes]:
    """``count`` new PNGs whose keys the router's cache_aware policy maps to ``encoder`` (all encoders up)."""
    fingerprint = stack.rig.client(info, stack.encoders[0])["vision_fingerprint"]
    ring, candidates = CacheAware(), [_Named(e.url) for e in stack.encoders]
    found: list[bytes] = []
    for s in range(seed, seed + 100 * count):
        data = png(40, 40, s)
        if ring.choose(candidates, image_key(data, fingerprint)).name == encoder.url:
            found.append(data)
            if len(found) == count:
                return found
    raise AssertionError(f"fewer than {count} images map to {encoder.url}")


def encoded_total(server: Server) -> float:
    for line in httpx.get(f"{server.url}/metrics", timeout=5).text.splitlines():
        if line.startswith("epd_encoder_images_encoded_total "):
            return float(line.split()[-1])
    raise AssertionError(f"epd_encoder_images_encoded_total not in {server.url}/metrics")
