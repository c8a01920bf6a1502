"""The router's health check of one worker (``router.fleet.discovery.check``) against a real HTTP server on
loopback: late answers take a worker out only after ``--health-timeouts`` in a row; a refused
connection or an error answer at once; an answer in time resets the count."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web

from router.fleet.breaker import CircuitBreaker
from router.config import RouterConfig
from router.fleet.discovery import check
from router.fleet.workers import Worker
from process.ports import free_port

TIMEOUT_S = 0.2


@pytest.fixture
async def stage():
    """A /health that answers 200, late (``state["late"]``) or 503 (``state["status"]``)."""
    state = {"late": False, "status": 200}

    async def health(request: web.Request) -> web.Response:
        if state["late"]:
            await asyncio.sleep(TIMEOUT_S * 5)
        return web.Response(status=state["status"], text="ok")

    app = web.Application()
    app.router.add_get("/health", health)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    yield f"http://127.0.0.1:{port}", state
    await runner.cleanup()


def config() -> RouterConfig:
    return RouterConfig(colocated=("http://127.0.0.1:1",), health_timeout_s=TIMEOUT_S, health_timeouts=3)


async def test_late_answers_mark_unhealthy_only_after_three_in_a_row(stage):
    url, state = stage
    worker = Worker(url, "decode", CircuitBreaker(3, 10.0), healthy=True, known=True)
    async with aiohttp.ClientSession() as session:
        state["late"] = True
        for _ in range(2):
            await check(session, worker, config())
            assert worker.healthy
        state["late"] = False
        await check(session, worker, config())  # an answer in time resets the count
        assert worker.healthy and worker.late_checks == 0
        state["late"] = True
        for expected in (True, True, False):
            await check(session, worker, config())
            assert worker.healthy is expected


async def test_an_error_answer_or_a_refused_connection_marks_unhealthy_at_once(stage):
    url, state = stage
    worker = Worker(url, "decode", CircuitBreaker(3, 10.0), healthy=True, known=True)
    async with aiohttp.ClientSession() as session:
        state["status"] = 503
        await check(session, worker, config())
        assert not worker.healthy
        gone = Worker(f"http://127.0.0.1:{free_port()}", "decode", CircuitBreaker(3, 10.0), healthy=True, known=True)
        await check(session, gone, config())
        assert not gone.healthy


@pytest.mark.unit
def test_health_timeouts_must_be_positive():
    with pytest.raises(ValueError, match="--health-timeouts must be > 0, got 0"):
        RouterConfig(colocated=("http://127.0.0.1:1",), health_timeouts=0)
