"""The pure part of DNS discovery (router/fleet/dns_source.py): parsing --discover and --discover-nameserver,
worker URLs of addresses, and plan(): the add / drain / resume lists a new answer asks for. Plus the
router's config and CLI taking the flags (the mode follows from discovered roles too)."""

from __future__ import annotations

import argparse

import pytest

from cli.router import add_router_args, router_config
from router.config import ROLES, RouterConfig
from router.fleet.dns_source import Changes, DnsSource, parse_discover, parse_nameserver, plan, worker_url

pytestmark = pytest.mark.unit


def test_parse_discover_both_schemes():
    assert parse_discover("prefill=dns://prefill.epd.svc.cluster.local:8000", ROLES) == \
        DnsSource("prefill", "dns", "prefill.epd.svc.cluster.local", 8000)
    source = parse_discover("decode=dns+srv://_http._tcp.decode.epd.svc", ROLES)
    assert source == DnsSource("decode", "dns+srv", "_http._tcp.decode.epd.svc", None)
    assert source.label == "dns+srv://_http._tcp.decode.epd.svc"
    assert parse_discover("colocated=dns://W.Test:1", ROLES).label == "dns://w.test:1"


@pytest.mark.parametrize("text, message", [
    ("dns://a:1", "--discover takes ROLE=dns://NAME:PORT or ROLE=dns+srv://NAME, got 'dns://a:1'"),
    ("pd=dns://a:1", "--discover: the role must be one of encoder, prefill, decode, colocated, got 'pd' in "
                     "'pd=dns://a:1'"),
    ("decode=http://a:1", "--discover takes ROLE=dns://NAME:PORT or ROLE=dns+srv://NAME, got 'decode=http://a:1'"),
    ("decode=dns://a", "--discover decode=dns://NAME:PORT needs the workers' port (1-65535), got 'decode=dns://a'"),
    ("decode=dns://a:0", "--discover decode=dns://NAME:PORT needs the workers' port (1-65535), got 'decode=dns://a:0'"),
    ("decode=dns://a:99999", "--discover: bad port in 'decode=dns://a:99999'"),
    ("decode=dns+srv://a:80", "--discover decode=dns+srv://NAME takes no port (each SRV record has its own), got "
                              "'decode=dns+srv://a:80'"),
    ("decode=dns://a:1/x", "--discover takes ROLE=dns://NAME:PORT or ROLE=dns+srv://NAME, got 'decode=dns://a:1/x'"),
])
def test_parse_discover_refusals(text, message):
    with pytest.raises(ValueError) as info:
        parse_discover(text, ROLES)
    assert str(info.value) == message


def test_parse_nameserver():
    assert parse_nameserver("10.96.0.10") == ("10.96.0.10", 53)
    assert parse_nameserver("127.0.0.1:5353") == ("127.0.0.1", 5353)
    assert parse_nameserver("::1") == ("::1", 53)
    assert parse_nameserver("[::1]:5353") == ("::1", 5353)
    for bad in ("kube-dns:53", "127.0.0.1:", "127.0.0.1:x", "[::1]"):
        with pytest.raises(ValueError) as info:
            parse_nameserver(bad)
        assert str(info.value) == ("--discover-nameserver takes IP[:PORT] (an IPv6 address bracketed with a port), "
                                   f"got {bad!r}")


def test_worker_url_brackets_ipv6():
    assert worker_url("10.1.2.3", 8000) == "http://10.1.2.3:8000"
    assert worker_url("fd00::7", 8000) == "http://[fd00::7]:8000"


A, B, C = "http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.3:8000"


@pytest.mark.parametrize("answer, serving, draining, taken, expected", [
    ({A}, set(), set(), set(), Changes(add=(A,))),                        # first answer
    ({A, B}, {A}, set(), set(), Changes(add=(B,))),                       # scaled up
    ({B}, {A, B}, set(), set(), Changes(drain=(A,))),                     # A's pod went away
    ({B, C}, {A}, set(), set(), Changes(add=(B, C), drain=(A,))),         # rolled over
    ({A, B}, {B}, {A}, set(), Changes(resume=(A,))),                      # A came back while draining
    ({B}, {B}, {A}, set(), Changes()),                                    # A still draining: left to its drain
    (set(), {A, B}, set(), set(), Changes()),                             # no address: keep the last answer
    ({A, B}, set(), set(), {A}, Changes(add=(B,))),                       # A is a static (or admin) worker
    ({A, B}, {A, B}, set(), set(), Changes()),                            # nothing new
])
def test_plan(answer, serving, draining, taken, expected):
    assert plan(answer, serving, draining, taken) == expected


def test_plan_lists_are_sorted():
    assert plan({C, A, B}, set(), set()) == Changes(add=(A, B, C))
    assert plan({C}, {B, A, C}, set()) == Changes(drain=(A, B))


def _config(*argv: str) -> RouterConfig:
    parser = argparse.ArgumentParser()
    add_router_args(parser)
    return router_config(parser.parse_args(list(argv)))


def test_cli_takes_discover_flags():
    config = _config("--discover", "prefill=dns://p.test:8000", "--discover", "decode=dns+srv://_d._tcp.test",
                     "--decode", "http://127.0.0.1:9000", "--discover-interval-s", "0.5",
                     "--discover-nameserver", "127.0.0.1:5353")
    assert config.mode == "pd"
    assert config.dns_sources == (DnsSource("prefill", "dns", "p.test", 8000),
                                  DnsSource("decode", "dns+srv", "_d._tcp.test", None))
    assert (config.discover_interval_s, config.discover_nameserver) == (0.5, "127.0.0.1:5353")
    assert _config("--discover", "colocated=dns://c.test:1").mode == "colocated"
    assert _config("--discover", "prefill=dns://p.test:1", "--discover", "decode=dns://d.test:1",
                   "--discover", "encoder=dns://e.test:1", "--redis-url", "redis://127.0.0.1:1").mode == "epd"


@pytest.mark.parametrize("argv, message", [
    (["--discover", "prefill=dns://p.test:1"], "pd mode needs both --prefill and --decode workers; --decode is missing"),
    (["--discover", "colocated=dns://c.test:1", "--prefill", "http://127.0.0.1:1"],
     "--colocated cannot be mixed with --prefill, --decode or --encoder: a router runs one mode"),
    (["--discover", "colocated=dns://c.test:1", "--discover", "colocated=dns://c.test:1"],
     "--discover names the same source twice: ['colocated=dns://c.test:1', 'colocated=dns://c.test:1']"),
    (["--discover", "colocated=dns://c.test:1", "--discover-interval-s", "0"], "--discover-interval-s must be > 0, got 0.0"),
    (["--discover", "colocated=dns://c.test:1", "--discover-nameserver", "dns.local"],
     "--discover-nameserver takes IP[:PORT] (an IPv6 address bracketed with a port), got 'dns.local'"),
    ([], "no workers: give --colocated URL, or --prefill URL and --decode URL (or --discover ROLE=dns://NAME:PORT for "
         "each)"),
])
def test_config_refusals(argv, message):
    with pytest.raises(ValueError) as info:
        _config(*argv)
    assert str(info.value) == message
