"""``AllowList``: which prefill bootstrap addresses a decode may dial (pure: no sockets, no DNS)."""

from __future__ import annotations

import pytest

from transfer.peer_policy import DEFAULT_ALLOWED_BOOTSTRAP, AllowList

pytestmark = pytest.mark.unit

EXPECTED = "expected a CIDR (10.1.0.0/16), host:port (10.0.0.5:8998) or host:* (prefill-1.rack2:*)"


def test_default_is_loopback_only() -> None:
    allow = AllowList()
    assert allow.patterns() == DEFAULT_ALLOWED_BOOTSTRAP == ("127.0.0.0/8", "::1/128")
    assert str(allow) == "127.0.0.0/8, ::1/128"
    for host, port in [("127.0.0.1", 8998), ("127.200.3.4", 1), ("::1", 65535), ("::ffff:127.0.0.1", 8998)]:
        assert allow.allows(host, port), (host, port)
    for host in ["10.0.0.1", "0.0.0.0", "128.0.0.1", "::2", "::", "localhost", "127.1", "127.000.000.001", "[::1]"]:
        assert not allow.allows(host, 8998), host  # a hostname is never resolved: "localhost" is not listed


def test_ports_out_of_range_are_denied() -> None:
    allow = AllowList()
    for port in [0, -1, 65536, True, "8998", 8998.0]:
        assert not allow.allows("127.0.0.1", port), port
    assert not allow.allows(None, 8998)


def test_cidr_v4_and_v6() -> None:
    allow = AllowList.parse(["10.1.0.0/16", "fd00::/8"])
    assert allow.patterns() == ("10.1.0.0/16", "fd00::/8")
    assert allow.allows("10.1.0.0", 1) and allow.allows("10.1.255.255", 65535)
    assert not allow.allows("10.2.0.1", 8998) and not allow.allows("10.0.255.255", 8998)
    assert not allow.allows("127.0.0.1", 8998)  # parse gives exactly the patterns, no default
    assert allow.allows("fd12:3456::5", 8998) and allow.allows("FD00::1", 8998)
    assert not allow.allows("fe80::1", 8998) and not allow.allows("::1", 8998)
    assert allow.allows("::ffff:10.1.2.3", 8998)  # IPv4-mapped: the same destination
    assert not allow.allows("::ffff:10.2.0.1", 8998)


def test_bare_ip_is_one_address_any_port() -> None:
    allow = AllowList.parse(["10.0.0.5", "fd00::5"])
    assert allow.patterns() == ("10.0.0.5/32", "fd00::5/128")
    assert allow.allows("10.0.0.5", 1) and allow.allows("fd00:0:0::5", 2)
    assert not allow.allows("10.0.0.6", 1)


def test_host_port_and_host_star() -> None:
    allow = AllowList.parse(["10.0.0.5:8998", "prefill-1.rack2:*", "Prefill-2:9000", "[fd00::5]:8998"])
    assert allow.patterns() == ("10.0.0.5:8998", "prefill-1.rack2:*", "prefill-2:9000", "[fd00::5]:8998")
    assert allow.allows("10.0.0.5", 8998) and not allow.allows("10.0.0.5", 8999)
    assert allow.allows("prefill-1.rack2", 1) and allow.allows("PREFILL-1.Rack2", 65535)
    assert allow.allows("prefill-2", 9000) and not allow.allows("prefill-2", 9001)
    assert allow.allows("fd00:0::5", 8998) and not allow.allows("fd00::5", 8999)
    for host in ["prefill-1.rack2.evil", "prefill-1", "rack2", "prefill-1.rack2.", "10.0.0.6", "prefill-3"]:
        assert not allow.allows(host, 8998), host


def test_parse_splits_commas() -> None:
    allow = AllowList.parse(["10.0.0.5:8998, 10.1.0.0/16", "p1:*"])
    assert allow.patterns() == ("10.0.0.5:8998", "10.1.0.0/16", "p1:*")
    assert AllowList.parse([]).patterns() == () and str(AllowList.parse([])) == "nothing"
    assert not AllowList.parse([]).allows("127.0.0.1", 8998)


BAD = [
    ("", "is empty"),
    ("10.1.0.5/16", "is not a valid CIDR (10.1.0.5/16 has host bits set)"),
    ("10.0.0.0/33", "is not a valid CIDR ('33' is not a valid netmask)"),
    ("prefill-1", "has no port: write prefill-1:* to allow any port, or prefill-1:PORT"),
    ("prefill-1:0", "has an invalid port '0' (1-65535 or *)"),
    ("prefill-1:65536", "has an invalid port '65536' (1-65535 or *)"),
    ("prefill-1:+80", "has an invalid port '+80' (1-65535 or *)"),
    ("prefill-1:", "has an invalid port '' (1-65535 or *)"),
    ("*:8998", "has an invalid host '*' (an IP, a [IPv6] or a hostname; no wildcards)"),
    ("*.rack2:8998", "has an invalid host '*.rack2' (an IP, a [IPv6] or a hostname; no wildcards)"),
    ("bad host:1", "has an invalid host 'bad host' (an IP, a [IPv6] or a hostname; no wildcards)"),
    ("[fd00::5]", "has no port: write [fd00::5]:* to allow any port, or [fd00::5]:PORT"),
    ("tcp://10.0.0.5:8998", "has an invalid host 'tcp://10.0.0.5' (an IP, a [IPv6] or a hostname; no wildcards)"),
]


@pytest.mark.parametrize(("pattern", "why"), BAD, ids=[b[0] or "empty" for b in BAD])
def test_bad_patterns_name_the_flag(pattern: str, why: str) -> None:
    with pytest.raises(ValueError) as info:
        AllowList.parse([pattern])
    assert str(info.value) == f"--allowed-bootstrap: {pattern!r} {why}; {EXPECTED}"


def test_add_and_remove_at_runtime() -> None:
    allow = AllowList.parse([])
    assert allow.add("[fd00::5]:8998") is True
    assert allow.add("[fd00:0::5]:8998") is False  # the same pattern, normalized
    assert allow.add("10.1.0.0/16") is True
    assert allow.allows("fd00::5", 8998) and allow.allows("10.1.2.3", 1)
    assert allow.remove("[FD00::5]:8998") is True
    assert not allow.allows("fd00::5", 8998)
    assert allow.remove("[fd00::5]:8998") is False  # already gone
    assert allow.remove("10.1.0.0/24") is False  # not a pattern that was added
    assert allow.patterns() == ("10.1.0.0/16",)
    with pytest.raises(ValueError, match="--allowed-bootstrap: 'nope' has no port"):
        allow.remove("nope")
    with pytest.raises(ValueError, match="--allowed-bootstrap: 'x:y' has an invalid port"):
        allow.add("x:y")
    assert allow.patterns() == ("10.1.0.0/16",)  # a bad pattern changes nothing
