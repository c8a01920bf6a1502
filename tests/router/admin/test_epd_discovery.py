"""Discovery of an EPD switchable worker (issue 34) against a stub that answers as one (``stage serve pd
--redis-url``; its contract, not its engine): given as an encoder it is told the role first and read as
an encoder; switched to prefill its local encoder id and vision fingerprint are read, to decode they
are cleared; a PD switchable worker's roles leave the encoder out."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from router.fleet.breaker import CircuitBreaker
from router.fleet.discovery import InfoError, read_info
from router.fleet.workers import Worker

TOKEN = "stub-admin-token-0123456789"
FINGERPRINT = {"model": "m", "backend": "mooncake", "block_size": 16}


class Switchable:
    """The answers of a switchable worker that can take ``roles``, in its current role."""

    def __init__(self, roles: list[str]) -> None:
        self.roles, self.role, self.told = roles, None, []

    def info(self) -> dict:
        common = {"role": self.role, "switchable": True, "roles": self.roles}
        if self.role == "encoder":
            return {**common, "model": "m", "encoder_id": "enc-1", "vision_fingerprint": "vf"}
        if self.role is None:
            return common
        local = {"encoder_id": "enc-1", "vision_fingerprint": "vf"} if "encoder" in self.roles else {}
        bootstrap = {"bootstrap": {"host": "0.0.0.0", "port": 9999}} if self.role == "prefill" else {}
        return {**common, "fingerprint": FINGERPRINT, **bootstrap, **(local if self.role == "prefill" else {})}

    async def server_info(self, request: web.Request) -> web.Response:
        return web.json_response(self.info())

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "m", "object": "model"}]})

    async def set_role(self, request: web.Request) -> web.Response:
        assert request.headers["Authorization"] == f"Bearer {TOKEN}"
        role = (await request.json())["role"]
        if role not in self.roles:
            return web.json_response({"error": {"message": f"cannot be {role}"}}, status=400)
        self.role = role
        self.told.append(role)
        return web.json_response({"role": role})


async def serve(stub: Switchable) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_get("/server_info", stub.server_info)
    app.router.add_get("/v1/models", stub.models)
    app.router.add_post("/role", stub.set_role)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}"


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as client:
        yield client


async def test_an_epd_switchable_worker_is_read_in_each_role(session):
    stub = Switchable(["encoder", "prefill", "decode"])
    runner, url = await serve(stub)
    try:
        worker = Worker(url, "encoder", CircuitBreaker(1, 10.0))
        await read_info(session, worker, 5.0, TOKEN)
        assert stub.told == ["encoder"]
        assert (worker.switchable, worker.roles, worker.encoder_id, worker.vision_fingerprint, worker.models) == (
            True, ("encoder", "prefill", "decode"), "enc-1", "vf", ("m",))
        assert (worker.fingerprint, worker.bootstrap, worker.known) == (None, None, True)
        worker.role = "prefill"  # as Registry.move does during a switch
        await read_info(session, worker, 5.0, TOKEN)
        assert stub.told == ["encoder", "prefill"]
        assert (worker.encoder_id, worker.vision_fingerprint, worker.fingerprint) == ("enc-1", "vf", FINGERPRINT)
        assert worker.bootstrap == ("127.0.0.1", 9999)
        worker.role = "decode"
        await read_info(session, worker, 5.0, TOKEN)
        assert (worker.encoder_id, worker.vision_fingerprint, worker.bootstrap) == (None, None, None)
        worker.role = "encoder"
        await read_info(session, worker, 5.0, TOKEN)
        assert (worker.encoder_id, worker.fingerprint, worker.bootstrap, worker.cards) == ("enc-1", None, None, ())
    finally:
        await runner.cleanup()


async def test_a_pd_switchable_worker_cannot_be_an_encoder(session):
    stub = Switchable(["prefill", "decode"])
    runner, url = await serve(stub)
    try:
        worker = Worker(url, "prefill", CircuitBreaker(1, 10.0))
        await read_info(session, worker, 5.0, TOKEN)
        assert (worker.roles, worker.encoder_id, worker.vision_fingerprint) == (("prefill", "decode"), None, None)
        with pytest.raises(InfoError) as error:
            await read_info(session, Worker(url, "encoder", CircuitBreaker(1, 10.0)), 5.0, TOKEN)
        assert str(error.value).startswith(f"{url} did not take the role encoder (HTTP 400): ")
    finally:
        await runner.cleanup()
