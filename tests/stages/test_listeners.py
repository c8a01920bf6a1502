"""Every listener of every role binds where it was told (docs/architecture.md, "Listeners").

Each role runs as a real process on 127.0.0.1 (the default ``--host``, ``--transfer-host`` and
``--bootstrap-host``): colocated, encoder, prefill and decode over Mooncake and over NIXL, a switchable
pd worker, the router, and the embedded Redis; the router's ``--host`` and the Mooncake prefill's
``--bootstrap-host`` are another loopback address, 127.0.0.2, so a listener that ignored its flag
shows. After a request through each PD pair, every listening TCP socket of each process (``psutil``)
must be on the address its flag gave. The one documented exception is
Mooncake's: its P2P handshake port (0.0.0.0) and TCP data port ([::]) bind every interface, in the port
range ``MC_MIN_RPC_PORT``..``MC_MAX_RPC_PORT``; a process that uses Mooncake has exactly those two and
no other. A negative control shows that a wildcard listener is caught.
"""

from __future__ import annotations

import asyncio
import random
import subprocess
import sys
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest

from stages.launch.health import wait_healthy
from process.ports import free_port
from tests.conftest import REPO, ServerProcess
from tests.support.redis_fixtures import redis_server  # noqa: F401
from transfer.base import TransferConfig
from transfer.ucx_listen import interface_of, ucx_params

pytestmark = pytest.mark.timeout(300)
HOST = "127.0.0.1"
OTHER_HOST = "127.0.0.2"  # the router's --host and the Mooncake prefill's --bootstrap-host
WILDCARDS = ("0.0.0.0", "::")
MOONCAKE_PORTS = (21000, 21999)  # MC_MIN_RPC_PORT..MC_MAX_RPC_PORT for this module's servers (default 15000-17000)
MOONCAKE_ENV = {"MC_MIN_RPC_PORT": str(MOONCAKE_PORTS[0]), "MC_MAX_RPC_PORT": str(MOONCAKE_PORTS[1])}
TOKEN = "admin-token-for-listener-tests-0123"
FAST = ("--kv-cache-mib", "16", "--pair-timeout-s", "5", "--transfer-timeout-s", "5")
Listener = tuple[str, int]


def listeners(pid: int) -> set[Listener]:
    """The (address, port) of every listening TCP socket of process ``pid`` and its children."""
    process = psutil.Process(pid)
    found = set()
    for proc in (process, *process.children(recursive=True)):
        found |= {(c.laddr.ip, c.laddr.port) for c in proc.net_connections("tcp") if c.status == psutil.CONN_LISTEN}
    return found


def mooncake_exception(listener: Listener) -> bool:
    """Mooncake's documented wildcard listeners: any interface, a port in MC_MIN_RPC_PORT..MC_MAX_RPC_PORT."""
    address, port = listener
    return address in WILDCARDS and MOONCAKE_PORTS[0] <= port <= MOONCAKE_PORTS[1]


def strays(found: Iterable[Listener], hosts: Iterable[str], mooncake: bool) -> list[Listener]:
    """Listeners on none of ``hosts`` and not excused (Mooncake's, only in a process that uses Mooncake)."""
    return sorted(item for item in found if item[0] not in hosts and not (mooncake and mooncake_exception(item)))


def assert_bound_as_told(pid: int, must_include: set[Listener], mooncake: bool) -> None:
    """``must_include`` listen; every listener is on one of their addresses, except Mooncake's two exactly."""
    found = listeners(pid)
    hosts = {address for address, _ in must_include}
    assert must_include <= found, f"expected {must_include} among {found}"
    assert strays(found, hosts, mooncake) == [], f"listeners off {hosts}: {found}"
    wildcards = sorted(address for address, _ in found if address in WILDCARDS)
    assert wildcards == (["0.0.0.0", "::"] if mooncake else []), f"Mooncake's two exactly: {found}"


def chat(bootstrap_port: int | None = None) -> dict:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    if bootstrap_port is not None:
        body |= {"bootstrap_host": HOST, "bootstrap_port": bootstrap_port, "bootstrap_room": random.getrandbits(63)}
    return body


def launch_router(flags: list[str], log_path) -> ServerProcess:
    """``stage serve router`` on OTHER_HOST (tests/conftest.py's launcher assumes 127.0.0.1)."""
    port = free_port(OTHER_HOST)
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen([sys.executable, "-m", "cli", "serve", "router", "--host", OTHER_HOST,
                                 "--port", str(port), *flags], cwd=REPO, stdout=log_file, stderr=subprocess.STDOUT)
    server = ServerProcess(f"http://{OTHER_HOST}:{port}", proc, log_path)
    try:
        wait_healthy(server.url, proc, 60)
    except (RuntimeError, TimeoutError) as exc:
        server.stop()
        raise RuntimeError(f"{exc}; router log:\n{server.log()[-4000:]}") from None
    return server


async def pair_answers(prefill, decode, bootstrap_port: int) -> None:
    body = chat(bootstrap_port)
    async with httpx.AsyncClient(timeout=60) as client:
        answers = await asyncio.gather(client.post(f"{prefill.url}/v1/chat/completions", json=body),
                                       client.post(f"{decode.url}/v1/chat/completions", json=body))
    assert [a.status_code for a in answers] == [200, 200], [a.text for a in answers]


@pytest.fixture(scope="module")
def stack(start_server, tiny_model, redis_server, tmp_path_factory):  # noqa: F811
    """One server per role (prefill and decode per backend), started in parallel, each having served."""
    model = str(tiny_model("qwen2_vl"))
    ports = {transfer: free_port() for transfer in ("mooncake", "nixl")}
    jobs = {"colocated": ("colocated", "--model", model, "--kv-cache-mib", "16"),
            "encoder": ("encoder", "--model", model, "--redis-url", redis_server.url),
            "pd": ("pd", "--model", model, "--transfer", "nixl", *FAST, "--bootstrap-port", str(free_port()),
                   "--admin-token", TOKEN)}
    for transfer, port in ports.items():
        common = ("--model", model, "--transfer", transfer, *FAST)
        jobs[f"prefill-{transfer}"] = ("prefill", *common, "--bootstrap-port", str(port))
        jobs[f"decode-{transfer}"] = ("decode", *common)
    jobs["prefill-mooncake"] += ("--bootstrap-host", OTHER_HOST)
    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = {name: pool.submit(start_server, *args, env=MOONCAKE_ENV) for name, args in jobs.items()}
        servers = {name: future.result() for name, future in futures.items()}
    router = launch_router(["--prefill", servers["prefill-mooncake"].url, "--decode", servers["decode-mooncake"].url],
                           tmp_path_factory.mktemp("router") / "router.log")
    servers["router"] = router
    role = httpx.post(f"{servers['pd'].url}/role", json={"role": "prefill"}, timeout=10,
                      headers={"Authorization": f"Bearer {TOKEN}"})
    assert role.status_code == 200, role.text
    answer = httpx.post(f"{servers['router'].url}/v1/chat/completions", json=chat(), timeout=60)
    assert answer.status_code == 200, answer.text
    asyncio.run(pair_answers(servers["prefill-nixl"], servers["decode-nixl"], ports["nixl"]))
    yield servers, ports
    router.stop()


# --- the check itself ------------------------------------------------------------------------------
@pytest.mark.parametrize("address", WILDCARDS)
def test_a_wildcard_listener_is_caught(address):
    """Negative control: a real process listening on a wildcard fails the check, even on a port in
    Mooncake's range, unless the process uses Mooncake."""
    family = "AF_INET6" if ":" in address else "AF_INET"
    script = (f"import socket, sys; s = socket.socket(socket.{family}); s.bind(({address!r}, {MOONCAKE_PORTS[0]} + "
              f"int(sys.argv[1]))); s.listen(); print('up', flush=True); sys.stdin.read()")
    for offset in range(100):  # the first port of the range that is free
        proc = subprocess.Popen([sys.executable, "-c", script, str(offset)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        try:
            if proc.stdout.readline().strip() != "up":
                continue
            listener = (address, MOONCAKE_PORTS[0] + offset)
            assert listeners(proc.pid) == {listener}
            assert strays(listeners(proc.pid), {HOST}, mooncake=False) == [listener]
            assert strays(listeners(proc.pid), {HOST}, mooncake=True) == []
            beyond = (address, MOONCAKE_PORTS[1] + 1)
            assert strays({beyond}, {HOST}, mooncake=True) == [beyond]
            assert strays({(HOST, 8000), ("192.0.2.2", 8000)}, {HOST}, mooncake=True) == [("192.0.2.2", 8000)]
            return
        finally:
            proc.kill()
            proc.wait(10)
    raise AssertionError("no free port in the first 100 of the range")


# --- every role ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["colocated", "encoder"])
def test_http_only_roles_listen_on_their_host_only(stack, name):
    servers, _ = stack
    assert_bound_as_told(servers[name].proc.pid, {(HOST, servers[name].port)}, mooncake=False)


def test_the_router_listens_on_its_host_only(stack):
    servers, _ = stack
    assert_bound_as_told(servers["router"].proc.pid, {(OTHER_HOST, servers["router"].port)}, mooncake=False)


@pytest.mark.parametrize("transfer", ["mooncake", "nixl"])
def test_prefill_listens_on_its_host_and_bootstrap_host(stack, transfer):
    servers, ports = stack
    server = servers[f"prefill-{transfer}"]
    bootstrap = (OTHER_HOST if transfer == "mooncake" else HOST, ports[transfer])
    info = httpx.get(f"{server.url}/server_info", timeout=10).json()
    assert info["bootstrap"] == {"host": bootstrap[0], "port": bootstrap[1]}
    assert_bound_as_told(server.proc.pid, {(HOST, server.port), bootstrap}, transfer == "mooncake")


@pytest.mark.parametrize("transfer", ["mooncake", "nixl"])
def test_decode_listens_on_its_host(stack, transfer):
    servers, _ = stack
    server = servers[f"decode-{transfer}"]
    assert_bound_as_told(server.proc.pid, {(HOST, server.port)}, transfer == "mooncake")


def test_switchable_worker_as_prefill_listens_on_its_host(stack):
    servers, _ = stack
    bootstrap = httpx.get(f"{servers['pd'].url}/server_info", timeout=10).json()["bootstrap"]
    assert bootstrap["host"] == HOST
    assert_bound_as_told(servers["pd"].proc.pid, {(HOST, servers["pd"].port), (HOST, bootstrap["port"])},
                         mooncake=False)


def test_embedded_redis_listens_on_loopback_only(redis_server):  # noqa: F811
    assert listeners(redis_server.process.pid) == {(HOST, redis_server.port)}


# --- where NIXL's UCX listens ----------------------------------------------------------------------
@pytest.mark.unit
def test_ucx_is_pinned_to_the_interface_of_the_transfer_host():
    loopback = next(name for name, addrs in psutil.net_if_addrs().items() if any(a.address == HOST for a in addrs))
    for host in ("127.0.0.1", "127.0.0.2", "localhost"):
        assert interface_of(host) == loopback
        assert ucx_params(TransferConfig(host=host)) == {"engine_config": f"NET_DEVICES={loopback}"}
    assert ucx_params(TransferConfig(protocol="rdma")) == {}
    assert ucx_params(TransferConfig(device="mlx5_0")) == {"ucx_devices": "mlx5_0"}
    with pytest.raises(ValueError, match=r"--transfer-host '198\.51\.100\.7' is on no network interface"):
        interface_of("198.51.100.7")  # TEST-NET-2: on no interface here


def test_a_nixl_server_refuses_a_transfer_host_on_no_interface_before_loading(tiny_model):
    command = [sys.executable, "-m", "cli", "serve", "decode", "--model", str(tiny_model("qwen2_vl")),
               "--transfer", "nixl", "--transfer-host", "198.51.100.7", "--port", str(free_port())]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    assert result.stderr == ("stage serve decode: error: --transfer-host '198.51.100.7' is on no network interface of "
                             "this machine; give one of its addresses (NIXL's UCX listens on that interface only)\n")
