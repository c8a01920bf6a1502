"""The rig itself: hosts on a bridge with both address families and nothing added to the root
namespace; a cut link makes packets vanish (a connect times out, it is not refused) until restored;
nftables drop (a timeout) and reject (refused at once) on one port, undone by ``unblock``; the sweep
deletes only namespaces of dead runs; without root the rig refuses, saying why."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO
from tests.multihost import rig as rigmod
from tests.multihost.rig import HOSTS, Rig

pytestmark = pytest.mark.timeout(120)
PORT = 7000
TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def rig(make_rig) -> Rig:
    return make_rig(4)


def _listen(address: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((address, port))
    sock.listen(64)
    return sock


def _connect(address: str, port: int) -> str:
    """How a connect from here ends within TIMEOUT_S: ``ok``, ``timeout`` or ``refused``."""
    try:
        socket.create_connection((address, port), timeout=TIMEOUT_S).close()
        return "ok"
    except TimeoutError:
        return "timeout"
    except ConnectionRefusedError:
        return "refused"


@pytest.fixture(scope="module")
def p1_server(rig):
    """Listeners on p1's two addresses (bound inside p1's namespace; the sockets stay there)."""
    socks = [rig.in_host("p1", _listen, rig.addr("p1", family), PORT) for family in (4, 6)]
    yield
    for sock in socks:
        sock.close()


def test_hosts_reach_each_other_on_both_families_and_the_root_namespace_gains_nothing(rig, p1_server):
    root_links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    assert rig.prefix not in root_links and "br0" not in root_links.split()
    names = set(os.listdir("/var/run/netns"))
    assert {rig.ns(h) for h in (*HOSTS, "switch")} <= names
    for host in HOSTS:
        addrs = subprocess.run(["ip", "-n", rig.ns(host), "-o", "addr", "show", "dev", "eth0"], capture_output=True,
                               text=True, check=True).stdout
        assert f"{rig.addr(host, 4)}/24" in addrs and f"{rig.addr(host, 6)}/64" in addrs
    for family in (4, 6):
        assert rig.client(_connect, rig.addr("p1", family), PORT) == "ok"
        assert rig.in_host("d2", _connect, rig.addr("p1", family), PORT) == "ok"
    root_addrs = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True, check=True).stdout
    assert rigmod.V4_PREFIX not in root_addrs and rigmod.V6_PREFIX not in root_addrs


def test_a_cut_link_swallows_packets_until_restored(rig, p1_server):
    rig.cut("p1")
    try:
        started = time.monotonic()
        assert rig.client(_connect, rig.addr("p1"), PORT) == "timeout"
        assert time.monotonic() - started >= TIMEOUT_S * 0.9
        assert rig.client(_connect, rig.addr("p1", 6), PORT) == "timeout"
        assert rig.client(_connect, rig.addr("p2"), 9) == "refused"  # the others are untouched
    finally:
        rig.restore("p1")
    assert rig.client(_connect, rig.addr("p1"), PORT) == "ok"


@pytest.mark.parametrize(("verdict", "seen"), [("drop", "timeout"), ("reject", "refused")])
def test_an_nft_rule_on_one_port_drops_or_rejects_until_removed(rig, p1_server, verdict, seen):
    other = rig.in_host("p1", _listen, rig.addr("p1"), PORT + 1)
    try:
        rig.block("p1", PORT, verdict)
        try:
            assert rig.client(_connect, rig.addr("p1"), PORT) == seen
            assert rig.client(_connect, rig.addr("p1", 6), PORT) == seen
            assert rig.client(_connect, rig.addr("p1"), PORT + 1) == "ok"  # one port only
        finally:
            assert rig.unblock("p1", PORT) == 1
        assert rig.client(_connect, rig.addr("p1"), PORT) == "ok"
        assert rig.unblock("p1", PORT) == 0
    finally:
        other.close()


def test_the_sweep_deletes_only_namespaces_of_dead_runs():
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale, live = f"{rigmod.PREFIX}{dead.pid}x0-sw", f"{rigmod.PREFIX}{os.getpid()}x999-sw"
    for name in (stale, live):
        subprocess.run(["ip", "netns", "add", name], check=True)
    left = subprocess.Popen(["ip", "netns", "exec", stale, "sleep", "60"])  # a server the dead run left
    try:
        deadline = time.monotonic() + 5
        while str(left.pid) not in subprocess.run(["ip", "netns", "pids", stale], capture_output=True,
                                                   text=True).stdout.split():
            assert time.monotonic() < deadline, "sleep never entered the namespace"
            time.sleep(0.02)
        swept = rigmod.sweep()
        names = set(os.listdir("/var/run/netns"))
        assert stale in swept and stale not in names
        assert live not in swept and live in names
        assert left.wait(5) == -9
    finally:
        left.kill()
        left.wait(5)
        for name in (stale, live):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


def test_without_root_the_rig_refuses_and_says_why():
    code = ("import os\n"
            "from tests.multihost.rig import RigUnavailable, require_namespaces\n"
            "os.setgid(65534); os.setuid(65534)\n"
            "try:\n    require_namespaces()\nexcept RigUnavailable as exc:\n    print(exc)\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "the multi-host rig needs root (network namespaces, veth, nft); euid is 65534", \
        done.stderr[-2000:]
