"""Addresses that do not assume loopback or IPv4 (issue 16, item 2).

Units of ``process.addresses``: ``host:port`` text with IPv6 bracketed, its parsing, and which local
interface holds a host (a name by its A and AAAA answers); ``stages.addresses.check_addresses`` on
configs (the CLI's one-line refusals are in tests/cli/test_mistakes.py). End to end: a prefill and a
decode whose HTTP servers and bootstrap endpoint are on ``::1`` serve a greedy answer equal to a
colocated server's, over NIXL (its transfer host ``::1`` too) and over Mooncake (whose handshake dials
IPv4 only, so its transfer host stays 127.0.0.1).
"""

from __future__ import annotations

import asyncio
import os
import random
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from stages.addresses import check_addresses
from cli import build_parser
from cli.serve import server_config
from stages.launch.health import wait_healthy
from process.children import stop_process
from tests.support import server_forks
from tests.conftest import MODEL_ROLES, REPO
from tests.support.devices import DEVICE
from process.addresses import check_local, host_port, interface_holding, is_wildcard, resolve, split_host_port

pytestmark = pytest.mark.timeout(300)
ELSEWHERE = "198.51.100.7"  # TEST-NET-2: on no interface of any test machine
LOOPBACK = next(name for name, addrs in psutil.net_if_addrs().items() if any(a.address == "127.0.0.1" for a in addrs))
HAS_V6_LOOPBACK = any(a.address == "::1" for a in psutil.net_if_addrs()[LOOPBACK])


# --- process.addresses ----------------------------------------------------------------------------
@pytest.mark.unit
@pytest.mark.parametrize("host, port, text", [
    ("127.0.0.1", 8998, "127.0.0.1:8998"), ("::1", 8998, "[::1]:8998"), ("fd00::2", "*", "[fd00::2]:*"),
    ("decode-0.svc", 1, "decode-0.svc:1"), ("::ffff:10.0.0.1", 0, "[::ffff:10.0.0.1]:0")])
def test_host_port_brackets_ipv6_only(host, port, text):
    assert host_port(host, port) == text


@pytest.mark.unit
@pytest.mark.parametrize("text, parsed", [
    ("127.0.0.1:8998", ("127.0.0.1", 8998)), ("[::1]:8998", ("::1", 8998)), ("[fd00::2]:0", ("fd00::2", 0)),
    ("decode-0.svc:65535", ("decode-0.svc", 65535))])
def test_split_host_port_inverts_host_port(text, parsed):
    assert split_host_port(text) == parsed
    assert host_port(*parsed) == text


@pytest.mark.unit
@pytest.mark.parametrize("text, message", [
    ("::1:8998", "'::1:8998': an IPv6 address takes brackets: [::1]:8998"),
    ("127.0.0.1", "'127.0.0.1' is not HOST:PORT (or [IPv6]:PORT) with a port in 0-65535"),
    ("[::1]8998", "'[::1]8998' is not HOST:PORT (or [IPv6]:PORT) with a port in 0-65535"),
    (":80", "':80' is not HOST:PORT (or [IPv6]:PORT) with a port in 0-65535"),
    ("host:65536", "'host:65536' is not HOST:PORT (or [IPv6]:PORT) with a port in 0-65535"),
    ("host:http", "'host:http' is not HOST:PORT (or [IPv6]:PORT) with a port in 0-65535")])
def test_split_host_port_refuses_in_one_line(text, message):
    with pytest.raises(ValueError) as caught:
        split_host_port(text)
    assert str(caught.value) == message


@pytest.mark.unit
def test_wildcards():
    assert [is_wildcard(h) for h in ("0.0.0.0", "::", "127.0.0.1", "::1", "localhost", "")] == \
        [True, True, False, False, False, False]


@pytest.mark.unit
def test_interfaces_holding_hosts():
    assert interface_holding("127.0.0.1") == interface_holding("127.0.0.2") == LOOPBACK  # all of 127/8
    assert interface_holding("localhost") == LOOPBACK  # a name: by its answers
    assert interface_holding(ELSEWHERE) is None
    for name, entries in psutil.net_if_addrs().items():  # every address of every interface is its own
        for entry in entries:
            if entry.family == socket.AF_INET:
                assert interface_holding(entry.address) in (name, LOOPBACK)


@pytest.mark.unit
@pytest.mark.skipif(not HAS_V6_LOOPBACK, reason="no ::1 on this machine's loopback interface")
def test_ipv6_hosts():
    assert interface_holding("::1") == LOOPBACK
    assert resolve("::1") == {__import__("ipaddress").ip_address("::1")}
    assert interface_holding("2001:db8::7") is None  # documentation prefix


@pytest.mark.unit
def test_check_local_messages():
    check_local("--bootstrap-host", "127.0.0.2", "decodes dial it")
    check_local("--bootstrap-host", "localhost", "decodes dial it")
    with pytest.raises(ValueError) as caught:
        check_local("--bootstrap-host", ELSEWHERE, "decodes dial it")
    assert str(caught.value) == (f"--bootstrap-host '{ELSEWHERE}' is on no network interface of this machine; give "
                                 "one of its addresses (decodes dial it)")
    with pytest.raises(ValueError) as caught:
        check_local("--transfer-host", "0.0.0.0", "peers dial it")
    assert str(caught.value) == "--transfer-host '0.0.0.0' is a wildcard; give this machine's address that peers dial it"
    with pytest.raises(ValueError, match=r"^--transfer-host 'no-such-host\.invalid' does not resolve: "):
        check_local("--transfer-host", "no-such-host.invalid", "peers dial it")


# --- stages.addresses.check_addresses on configs -------------------------------------------------
def config_of(role: str, *flags: str):
    args = build_parser().parse_args(["serve", role, "--model", "/m", *flags])
    return server_config(args, role)


@pytest.mark.unit
def test_loopback_and_wildcard_binds_pass():
    check_addresses(config_of("decode"))
    check_addresses(config_of("prefill", "--bootstrap-host", "127.0.0.2", "--transfer-host", "localhost"))
    check_addresses(config_of("colocated", "--host", "0.0.0.0"))
    check_addresses(config_of("prefill", "--host", "0.0.0.0", "--bootstrap-host", "0.0.0.0",
                              "--transfer-host", "127.0.0.1"))


@pytest.mark.unit
@pytest.mark.parametrize("role, flags, flag, why", [
    ("colocated", ("--host", ELSEWHERE), "--host", "the HTTP server listens on it"),
    ("encoder", ("--host", ELSEWHERE, "--redis-url", "redis://127.0.0.1:1/0"), "--host",
     "the HTTP server listens on it"),
    ("decode", ("--transfer-host", ELSEWHERE), "--transfer-host", "peers dial it for the KV"),
    ("pd", ("--bootstrap-host", ELSEWHERE), "--bootstrap-host", "decodes dial it for the KV handshake"),
    ("prefill", ("--bootstrap-host", ELSEWHERE), "--bootstrap-host", "decodes dial it for the KV handshake")])
def test_an_address_on_no_interface_is_refused(role, flags, flag, why):
    with pytest.raises(ValueError) as caught:
        check_addresses(config_of(role, *flags), "--transfer-host")
    assert str(caught.value) == (f"{flag} '{ELSEWHERE}' is on no network interface of this machine; give one of its "
                                 f"addresses ({why})")


@pytest.mark.unit
@pytest.mark.skipif(not HAS_V6_LOOPBACK, reason="no ::1 on this machine's loopback interface")
def test_mooncake_refuses_an_ipv6_only_transfer_host_and_nixl_takes_it():
    with pytest.raises(ValueError) as caught:
        check_addresses(config_of("decode", "--host", "::1"), "--host")
    assert str(caught.value) == ("--host '::1' has no IPv4 address, and Mooncake's handshake dials IPv4 only; give an "
                                 "IPv4 --transfer-host (HTTP and the bootstrap may stay on IPv6) or use --transfer nixl")
    check_addresses(config_of("decode", "--host", "::1", "--transfer-host", "127.0.0.1"))
    check_addresses(config_of("prefill", "--host", "::1", "--bootstrap-host", "::1", "--transfer", "nixl"))


# --- a P/D pair on ::1, end to end -----------------------------------------------------------------
def free_port_v6() -> int:
    with socket.socket(socket.AF_INET6) as sock:
        sock.bind(("::1", 0))
        return sock.getsockname()[1]


class V6Servers:
    """Stage servers on ``::1`` (``tests.conftest.launch`` assumes 127.0.0.1), stopped at the end."""

    def __init__(self, logs: Path) -> None:
        self.logs, self.procs = logs, []

    def start(self, role: str, *flags: str) -> str:
        port = free_port_v6()
        argv = ["serve", role, *flags, "--host", "::1", "--port", str(port)]
        if role in MODEL_ROLES and "--device" not in flags:
            argv += ["--device", DEVICE]
        log_path = self.logs / f"{role}-{len(self.procs)}.log"
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if server_forks.forked(role):
            proc = server_forks.start(argv, log_path, env)
        else:
            with open(log_path, "wb") as out:
                proc = subprocess.Popen([sys.executable, "-m", "cli", *argv], cwd=REPO, stdout=out,
                                        stderr=subprocess.STDOUT, env=env)
        self.procs.append(proc)
        url = f"http://{host_port('::1', port)}"
        try:
            wait_healthy(url, proc, 180)
        except (RuntimeError, TimeoutError) as exc:
            raise RuntimeError(f"{exc}; log:\n{log_path.read_text(errors='replace')[-4000:]}") from None
        return url


@pytest.fixture(scope="module")
def v6(tmp_path_factory) -> Iterator[V6Servers]:
    if not HAS_V6_LOOPBACK:
        pytest.fail("no ::1 on the loopback interface: the IPv6 end-to-end test cannot run here")
    servers = V6Servers(tmp_path_factory.mktemp("v6-logs"))
    yield servers
    for proc in servers.procs:
        stop_process(proc)


@pytest.fixture(scope="module")
def colocated(start_server, tiny_model):
    return start_server("colocated", "--model", str(tiny_model("qwen2_vl")), "--kv-cache-mib", "16")


# (transfer, the prefill's and decode's transfer flags)
PAIRS = {"nixl": ("--transfer", "nixl"), "mooncake": ("--transfer", "mooncake", "--transfer-host", "127.0.0.1")}


@pytest.mark.parametrize("transfer", sorted(PAIRS))
async def test_a_pd_pair_on_ipv6_loopback_answers_as_colocated(v6, colocated, tiny_model, transfer):
    model, bootstrap_port = str(tiny_model("qwen2_vl")), free_port_v6()
    prefill = v6.start("prefill", "--model", model, *PAIRS[transfer], "--kv-cache-mib", "16",
                       "--bootstrap-host", "::1", "--bootstrap-port", str(bootstrap_port))
    decode = v6.start("decode", "--model", model, *PAIRS[transfer], "--kv-cache-mib", "16")
    body = {"messages": [{"role": "user", "content": "tell me about ipv6"}], "max_tokens": 10, "temperature": 0,
            "ignore_eos": True}
    room = {**body, "bootstrap_host": "::1", "bootstrap_port": bootstrap_port,
            "bootstrap_room": random.getrandbits(63)}
    async with httpx.AsyncClient(timeout=60) as client:
        info = (await client.get(f"{prefill}/server_info")).json()
        p, d, c = await asyncio.gather(client.post(f"{prefill}/v1/chat/completions", json=room),
                                       client.post(f"{decode}/v1/chat/completions", json=room),
                                       client.post(f"{colocated.url}/v1/chat/completions", json=body))
        links = (await client.get(f"{decode}/server_info")).json()["peer_links"]["open"]
    assert info["bootstrap"] == {"host": "::1", "port": bootstrap_port}
    assert (p.status_code, d.status_code, c.status_code) == (200, 200, 200), (p.text, d.text)
    assert d.json()["choices"][0]["message"]["content"] == c.json()["choices"][0]["message"]["content"]
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")  # cached_tokens: each server's own cache
    assert {k: d.json()["usage"][k] for k in counts} == {k: c.json()["usage"][k] for k in counts}
    assert links == [f"[::1]:{bootstrap_port}"]
