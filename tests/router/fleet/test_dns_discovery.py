"""The router finds its workers by DNS (``--discover``, router/fleet/dns_watch.py) from a real DNS server
(Debian's dnsmasq, tests/support/dnsmasq.py) whose records change while traffic flows through the official
openai client. Two colocated servers listen on 127.0.0.2 and 127.0.0.3 at one port (all of 127/8 is
local on Linux), so one ``dns://NAME:PORT`` names both.

For A records and for SRV records alike: the router starts with the one worker DNS names; the second
is published mid-traffic and is admitted and serves; the first is withdrawn mid-traffic and is
drained, then removed: no request fails, and it gets no request after its removal. DNS blinking
(dnsmasq frozen: timeouts; the name deleted: NXDOMAIN) changes nothing and is counted.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import Callable

import httpx
import openai
import pytest

from stages.launch.health import wait_healthy
from process.ports import free_port
from process.children import stop_process
from tests.support import server_forks
from tests.conftest import ServerProcess
from tests.support.devices import DEVICE
from tests.support.dnsmasq import Dnsmasq

pytestmark = pytest.mark.timeout(300)
TOKEN = "dns-admin-token-0123456789abcdef"
HOSTS = ("127.0.0.2", "127.0.0.3")
FINISHED = 'epd_requests_total{finish_reason="length"}'
CONCURRENCY = 4
WAIT_S = 30.0  # every wait below is bounded by this


def _port_on_both() -> int:
    """A port free on 127.0.0.2 and on 127.0.0.3."""
    for _ in range(20):
        port = free_port()
        socks = [socket.socket() for _ in HOSTS]
        try:
            for sock, host in zip(socks, HOSTS):
                sock.bind((host, port))
            return port
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise AssertionError("no port free on both 127.0.0.2 and 127.0.0.3")


@pytest.fixture(scope="module")
def workers(tiny_model, tmp_path_factory):
    """Two colocated servers, at http://127.0.0.2:P and http://127.0.0.3:P."""
    port, logs, started = _port_on_both(), tmp_path_factory.mktemp("dns-workers"), []
    try:
        for host in HOSTS:
            argv = ["serve", "colocated", "--model", str(tiny_model("qwen2_vl")), "--device", DEVICE,
                    "--host", host, "--port", str(port)]
            proc = server_forks.start(argv, logs / f"{host}.log", {**os.environ, "PYTHONUNBUFFERED": "1"})
            server = ServerProcess(f"http://{host}:{port}", proc, logs / f"{host}.log")
            started.append(server)
            try:
                wait_healthy(server.url, proc, 180)  # type: ignore[arg-type]
            except (RuntimeError, TimeoutError) as exc:
                raise AssertionError(f"{exc}; log:\n{server.log()[-3000:]}") from None
        yield started
    finally:
        for server in started:
            stop_process(server.proc)  # type: ignore[arg-type]


def _router(start_server, dns: Dnsmasq, source: str) -> ServerProcess:
    return start_server("router", "--discover", f"colocated={source}", "--discover-nameserver", dns.address,
                        "--discover-interval-s", "0.2", "--health-interval-s", "0.5", "--health-timeout-s", "1",
                        "--drain-timeout-s", "30", "--admin-token", TOKEN)


def listing(router: ServerProcess) -> dict[str, dict]:
    """The admin listing by URL."""
    response = httpx.get(f"{router.url}/admin/workers", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
    assert response.status_code == 200, response.text
    return {w["url"]: w for w in response.json()["workers"]}


def finished(server: ServerProcess) -> float:
    for line in httpx.get(f"{server.url}/metrics", timeout=10).text.splitlines():
        if line.startswith(FINISHED + " "):
            return float(line.split()[-1])
    return 0.0


async def until(what: str, ok: Callable[[], bool]) -> None:
    """Poll ``ok`` (off the event loop, so the load keeps flowing) until true, at most ``WAIT_S``."""
    deadline = time.monotonic() + WAIT_S
    while not await asyncio.to_thread(ok):
        assert time.monotonic() < deadline, f"not within {WAIT_S} s: {what}"
        await asyncio.sleep(0.1)


class Load:
    """``CONCURRENCY`` clients sending chat requests back to back through the router until ``stop``;
    every answer must be the full greedy text (4 tokens)."""

    def __init__(self, router: ServerProcess) -> None:
        self.client = openai.AsyncOpenAI(base_url=router.base_url, api_key="x", max_retries=0, timeout=60)
        self.done, self.errors = 0, []  # type: ignore[var-annotated]
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    async def __aenter__(self) -> Load:
        model = (await self.client.models.list()).data[0].id
        self._tasks = [asyncio.create_task(self._loop(model, i)) for i in range(CONCURRENCY)]
        return self

    async def _loop(self, model: str, i: int) -> None:
        while not self._stop.is_set():
            try:
                reply = await self.client.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": f"dns {i}"}], max_tokens=4, temperature=0,
                    extra_body={"ignore_eos": True})
                assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 4, reply
                self.done += 1
            except Exception as exc:  # every failure is reported by __aexit__
                self.errors.append(repr(exc))

    async def more(self, count: int) -> None:
        """Until ``count`` more requests have succeeded."""
        target = self.done + count
        await until(f"{count} more requests", lambda: self.done >= target)

    async def __aexit__(self, *exc_info: object) -> None:
        self._stop.set()
        await asyncio.wait_for(asyncio.gather(*self._tasks), WAIT_S)
        await self.client.close()
        assert self.errors == [], self.errors[:5]


async def scale_over(router: ServerProcess, first: ServerProcess, second: ServerProcess, source: str,
                     publish_both: Callable[[], None], publish_second: Callable[[], None]) -> None:
    """Under load: ``second`` is published and serves; ``first`` is withdrawn, drained and removed,
    then gets no request while the load goes on. No request fails."""
    assert {url: w["source"] for url, w in listing(router).items()} == {first.url: source}
    async with Load(router) as load:
        await load.more(8)
        await asyncio.to_thread(publish_both)
        await until(f"{second.url} admitted", lambda: listing(router).get(second.url, {}).get("healthy") is True)
        assert listing(router)[second.url]["source"] == source
        served = await asyncio.to_thread(finished, second)
        await until(f"{second.url} serving", lambda: finished(second) > served)
        await asyncio.to_thread(publish_second)
        await until(f"{first.url} drained and removed", lambda: first.url not in listing(router))
        count = await asyncio.to_thread(finished, first)
        await load.more(16)
        assert await asyncio.to_thread(finished, first) == count
    assert list(listing(router)) == [second.url]
    assert f"{source}: colocated {first.url} (w1) left the answer; draining it" in router.log()
    removed = [line for line in router.log().splitlines() if f"{source}: removed colocated {first.url}" in line]
    assert len(removed) == 1 and removed[0].endswith(")"), removed  # once, idle (not after --drain-timeout-s)


def dns_failures(router: ServerProcess, source: str, kind: str) -> float:
    name = f'epd_router_dns_failures_total{{kind="{kind}",source="{source}"}}'
    for line in httpx.get(f"{router.url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not in the router's /metrics")


# --- A records ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def a_dns(tmp_path_factory, workers):
    first = workers[0].url.split("//")[1].split(":")[0]
    server = Dnsmasq.start(tmp_path_factory.mktemp("dns-a"), {"w.test": [first]})
    yield server
    server.stop()


def test_a_records_followed_under_load(start_server, workers, a_dns):
    first, second = workers
    source = f"dns://w.test:{first.port}"
    router = _router(start_server, a_dns, source)
    asyncio.run(scale_over(router, first, second, source, lambda: a_dns.set_hosts({"w.test": list(HOSTS)}),
                           lambda: a_dns.set_hosts({"w.test": [HOSTS[1]]})))
    # DNS blinks under load: a frozen server (timeouts), then the name deleted (NXDOMAIN): nothing changes
    asyncio.run(blinks(router, a_dns, second, source))


async def blinks(router: ServerProcess, dns: Dnsmasq, worker: ServerProcess, source: str) -> None:
    timeouts, missing = dns_failures(router, source, "timeout"), dns_failures(router, source, "nxdomain")
    async with Load(router) as load:
        dns.pause()
        try:
            await until("a DNS timeout counted", lambda: dns_failures(router, source, "timeout") > timeouts)
            await load.more(8)
        finally:
            dns.resume()
        await asyncio.to_thread(dns.set_hosts, {})
        await until("an NXDOMAIN counted", lambda: dns_failures(router, source, "nxdomain") > missing)
        served = await asyncio.to_thread(finished, worker)
        await load.more(8)
        assert await asyncio.to_thread(finished, worker) >= served + 8
    assert {url: (w["source"], w["draining"]) for url, w in listing(router).items()} == {worker.url: (source, False)}
    assert "w.test does not exist (NXDOMAIN); it keeps its 1 worker(s)" in router.log()


# --- SRV records --------------------------------------------------------------------------------
def test_srv_records_followed_under_load(start_server, workers, tmp_path_factory):
    first, second = workers
    port = first.port
    name = "_stage._tcp.pool.test"
    both = {"a.test": [HOSTS[0]], "b.test": [HOSTS[1]]}
    dns = Dnsmasq.start(tmp_path_factory.mktemp("dns-srv"), both, srv=[(name, "a.test", port)])
    try:
        source = f"dns+srv://{name}"
        router = _router(start_server, dns, source)
        asyncio.run(scale_over(router, first, second, source,
                               lambda: dns.restart([(name, "a.test", port), (name, "b.test", port)]),
                               lambda: dns.restart([(name, "b.test", port)])))
    finally:
        dns.stop()
