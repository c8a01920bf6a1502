"""The overload itself: ``clients`` concurrent clients, each sending ``per_client`` requests one after
another (no retries, no pause: a refusal is answered and the client goes on), all within a deadline;
then whether every process answers again."""

from __future__ import annotations

import asyncio
import time

import httpx

from bench.overload.client import one

RECOVERY_S = 30.0  # how long the stack has after the burst to answer /health and a request again
POLL_S = 0.5


async def burst(url: str, clients: int, per_client: int, max_tokens: int, request_timeout_s: float,
                deadline_s: float) -> tuple[list[dict], bool]:
    """The outcome records of every request answered (``client.one``), and whether all were answered
    within ``deadline_s`` (those still running then are cancelled and missing from the records)."""
    records: list[dict] = []
    t0 = time.monotonic()
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(timeout=request_timeout_s, limits=limits) as client:

        async def run_client(c: int) -> None:
            for k in range(per_client):
                records.append(await one(client, url, c * per_client + k, max_tokens, t0))

        tasks = [asyncio.create_task(run_client(c)) for c in range(clients)]
        _, pending = await asyncio.wait(tasks, timeout=deadline_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    return records, not pending


def recovered(urls: dict[str, str], router_url: str, max_tokens: int) -> dict[str, bool]:
    """{name: ok} for each of ``urls`` answering /health 200, and ``request`` for a plain request
    through ``router_url`` answered 200 with a whole body, each polled until ok or ``RECOVERY_S``."""
    deadline = time.monotonic() + RECOVERY_S
    out = {name: _poll(lambda u=u: httpx.get(f"{u}/health", timeout=5).status_code == 200, deadline)
           for name, u in urls.items()}

    def request_ok() -> bool:
        async def go() -> dict:
            async with httpx.AsyncClient(timeout=30) as client:
                return await one(client, router_url, 0, max_tokens, time.monotonic())
        record = asyncio.run(go())
        return record["status"] == 200 and record["body_ok"]

    out["request"] = _poll(request_ok, deadline)
    return out


def _poll(check, deadline: float) -> bool:
    while True:
        try:
            if check():
                return True
        except httpx.HTTPError:
            pass
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_S)
