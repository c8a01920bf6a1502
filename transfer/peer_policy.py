"""Which prefill bootstrap addresses a decode may dial: ``AllowList`` (pure: no I/O, no DNS).

A request names its prefill's bootstrap ``host:port``; decode's ``BootstrapClient`` dials it only
when the decode's allow-list says so, so a request body can never make a server dial an arbitrary
address. Patterns (``--allowed-bootstrap``, or registered at runtime by the router):

- a CIDR, IPv4 or IPv6 (``127.0.0.0/8``, ``10.1.0.0/16``, ``fd00::/8``), or a bare IP (one address):
  any port on those addresses;
- ``host:port`` (``10.0.0.5:8998``, ``prefill-1.rack2:8998``, ``[fd00::5]:8998``): that port only;
- ``host:*`` (``prefill-1.rack2:*``): any port on that host.

Hosts in requests are matched as written: an IP against the networks and the IP hosts, a hostname
only against hostname patterns, case-insensitively. Nothing is ever resolved: a hostname that is
not listed is denied even if it resolves to an allowed address. An IPv4-mapped IPv6 address
(``::ffff:10.0.0.5``) also matches the patterns of its IPv4 address. IPv6 patterns with a port
need brackets (``fd00::5:8998`` reads as one IPv6 address).

The default (``AllowList()``) allows loopback only. One event loop owns an ``AllowList``: it is not
thread-safe.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Sequence

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
Rule = IPNetwork | tuple[str, int | None]  # a network, or (host, port) with port None for any port

DEFAULT_ALLOWED_BOOTSTRAP = ("127.0.0.0/8", "::1/128")
FLAG = "--allowed-bootstrap"
_EXPECTED = "expected a CIDR (10.1.0.0/16), host:port (10.0.0.5:8998) or host:* (prefill-1.rack2:*)"
_LABEL = r"[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?"
_HOSTNAME = re.compile(rf"{_LABEL}(?:\.{_LABEL})*")


class AllowList:
    """The bootstrap addresses one decode may dial.

    Built from ``--allowed-bootstrap`` at start (``parse``); the router's admin API may ``add`` and
    ``remove`` patterns at runtime. ``allows`` is asked before anything is dialed.
    """

    def __init__(self, patterns: Iterable[str] = DEFAULT_ALLOWED_BOOTSTRAP) -> None:
        self._rules: dict[Rule, None] = {}  # ordered, for messages
        for pattern in patterns:
            self.add(pattern)

    @classmethod
    def parse(cls, values: Sequence[str]) -> AllowList:
        """The allow-list of the flag's values, each one pattern or several joined by commas.

        Exactly the patterns given (an empty list allows nothing until the router registers a
        prefill); raises ``ValueError`` naming ``--allowed-bootstrap`` on the first bad pattern.
        """
        return cls(part.strip() for value in values for part in value.split(","))

    def allows(self, host: str, port: int) -> bool:
        """Whether a request may make this decode dial ``host:port``. Never resolves ``host``."""
        if not isinstance(host, str) or not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
            return False
        ip = _ip(host)
        if ip is None:
            name = host.lower()
            return (name, port) in self._rules or (name, None) in self._rules
        forms: list[IPAddress] = [ip] if not (isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped) else [ip, ip.ipv4_mapped]
        return any(self._allows_ip(form, port) for form in forms)

    def add(self, pattern: str) -> bool:
        """Allow ``pattern``; True if it was new. Raises ``ValueError`` if it is not a valid pattern."""
        rule = parse_pattern(pattern)
        if rule in self._rules:
            return False
        self._rules[rule] = None
        return True

    def remove(self, pattern: str) -> bool:
        """Stop allowing ``pattern`` (as written when added, up to normalization); True if it was there.

        Links already open to the address stay until idle; new requests to it are refused.
        """
        rule = parse_pattern(pattern)
        if rule not in self._rules:
            return False
        del self._rules[rule]
        return True

    def patterns(self) -> tuple[str, ...]:
        """The normalized patterns, in the order they were added."""
        return tuple(map(format_rule, self._rules))

    def __str__(self) -> str:
        return ", ".join(self.patterns()) or "nothing"

    def _allows_ip(self, ip: IPAddress, port: int) -> bool:
        text = str(ip)
        if (text, port) in self._rules or (text, None) in self._rules:
            return True
        return any(not isinstance(rule, tuple) and ip in rule for rule in self._rules)


def parse_pattern(pattern: str) -> Rule:
    """One ``--allowed-bootstrap`` pattern as a rule; ``ValueError`` naming the flag if invalid."""
    text = pattern.strip()
    if not text:
        raise _invalid(pattern, "is empty")
    ip = _ip(text.partition("/")[0])
    if ip is not None:  # a CIDR or a bare IP
        try:
            return (ipaddress.IPv4Network if ip.version == 4 else ipaddress.IPv6Network)(text)
        except ValueError as e:
            raise _invalid(pattern, f"is not a valid CIDR ({e})") from None
    host, sep, port_text = (text[1:].partition("]:") if text.startswith("[") else text.rpartition(":"))
    if not sep:
        raise _invalid(pattern, f"has no port: write {text}:* to allow any port, or {text}:PORT")
    return _host(pattern, host), _port(pattern, port_text)


def format_rule(rule: Rule) -> str:
    if not isinstance(rule, tuple):
        return str(rule)
    host, port = rule
    shown = f"[{host}]" if ":" in host else host
    return f"{shown}:{'*' if port is None else port}"


def _host(pattern: str, host: str) -> str:
    ip = _ip(host)
    if ip is not None:
        return str(ip)
    name = host.lower()
    if len(name) > 253 or not _HOSTNAME.fullmatch(name):
        raise _invalid(pattern, f"has an invalid host {host!r} (an IP, a [IPv6] or a hostname; no wildcards)")
    return name


def _port(pattern: str, text: str) -> int | None:
    if text == "*":
        return None
    if not (text.isascii() and text.isdigit()) or not 0 < int(text) < 65536:
        raise _invalid(pattern, f"has an invalid port {text!r} (1-65535 or *)")
    return int(text)


def _ip(host: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def _invalid(pattern: str, why: str) -> ValueError:
    return ValueError(f"{FLAG}: {pattern!r} {why}; {_EXPECTED}")
