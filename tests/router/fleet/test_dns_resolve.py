"""router/fleet/dns_resolve.py against a real dnsmasq (tests/support/dnsmasq.py): A and AAAA addresses as worker
URLs (IPv6 bracketed), SRV records through their targets' addresses, and each failure's kind."""

from __future__ import annotations

import asyncio
import time

import pytest

from router.config import ROLES
from router.fleet.dns_resolve import DnsFailure, make_resolver, resolve
from router.fleet.dns_source import parse_discover
from tests.support.dnsmasq import Dnsmasq

SRV = "_stage._tcp.pool.test"


@pytest.fixture(scope="module")
def dns(tmp_path_factory):
    server = Dnsmasq.start(tmp_path_factory.mktemp("dns-resolve"),
                           {"w.test": ["127.0.0.2", "127.0.0.3"], "v6.test": ["::1", "127.0.0.4"],
                            "a.test": ["127.0.0.5"], "b.test": ["fd00::5"]},
                           srv=[(SRV, "a.test", 8001), (SRV, "b.test", 8002), ("_none._tcp.pool.test", "nx.test", 1)])
    yield server
    server.stop()


def answer(dns: Dnsmasq, flag: str, timeout_s: float = 1.0) -> frozenset[str]:
    resolver = make_resolver(("127.0.0.1", dns.port), timeout_s)
    return asyncio.run(resolve(resolver, parse_discover(flag, ROLES)))


def failure(dns: Dnsmasq, flag: str, timeout_s: float = 1.0) -> DnsFailure:
    with pytest.raises(DnsFailure) as info:
        answer(dns, flag, timeout_s)
    return info.value


def test_addresses_and_srv_records(dns):
    assert answer(dns, "decode=dns://w.test:8000") == {"http://127.0.0.2:8000", "http://127.0.0.3:8000"}
    assert answer(dns, "decode=dns://v6.test:8000") == {"http://[::1]:8000", "http://127.0.0.4:8000"}
    assert answer(dns, f"decode=dns+srv://{SRV}") == {"http://127.0.0.5:8001", "http://[fd00::5]:8002"}


def test_failure_kinds(dns):
    missing = failure(dns, "decode=dns://gone.test:8000")
    assert (missing.kind, str(missing)) == ("nxdomain", "gone.test does not exist (NXDOMAIN)")
    # an SRV record whose target does not exist fails the whole answer (never half of one)
    assert failure(dns, "decode=dns+srv://_none._tcp.pool.test").kind == "nxdomain"
    refused = failure(dns, "decode=dns://elsewhere.example:8000")  # not dnsmasq's zone, nowhere to forward
    assert refused.kind == "servfail" and "REFUSED" in str(refused)
    dns.pause()
    try:
        started = time.monotonic()
        late = failure(dns, "decode=dns://w.test:8000", timeout_s=0.5)
        assert late.kind == "timeout" and time.monotonic() - started < 2
    finally:
        dns.resume()
    assert answer(dns, "decode=dns://w.test:8000") == {"http://127.0.0.2:8000", "http://127.0.0.3:8000"}
