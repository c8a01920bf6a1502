"""Host addresses, IPv4 and IPv6 alike: ``host:port`` text and whether a host is this machine's.

    host_port("10.0.0.2", 8998) -> "10.0.0.2:8998"      host_port("fd00::2", 8998) -> "[fd00::2]:8998"
    split_host_port("[fd00::2]:8998") -> ("fd00::2", 8998)
    interface_holding("fd00::2") -> "eth0" (or None)    check_local("--bootstrap-host", "10.9.9.9") -> ValueError

Every ``host:port`` a stage, the transfer layer or the router formats goes through ``host_port`` (an
IPv6 literal is bracketed; a hostname or IPv4 address is not). ``check_local`` is how a stage refuses,
at start, to hand out an address that is on none of its own network interfaces. No torch, no NIXL;
psutil is imported on first use, so the CLI stays fast.
"""

from __future__ import annotations

import ipaddress
import socket

Address = ipaddress.IPv4Address | ipaddress.IPv6Address


def host_port(host: str, port: int | str) -> str:
    """``host:port``, with an IPv6 literal bracketed (``[::1]:8998``) so the port is never ambiguous."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def split_host_port(text: str) -> tuple[str, int]:
    """The host (without brackets) and port of ``host:port`` or ``[v6]:port``. ValueError when there is
    no port, the port is not 0-65535, or an IPv6 literal is not bracketed."""
    if text.startswith("["):
        host, sep, port = text[1:].partition("]:")
    else:
        host, sep, port = text.rpartition(":")
        if ":" in host:
            raise ValueError(f"{text!r}: an IPv6 address takes brackets: [{host}]:{port}")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{text!r} is not HOST:PORT (or [IPv6]:PORT) with a port in 0-65535")
    return host, int(port)


def is_wildcard(host: str) -> bool:
    """Whether ``host`` is an address that means every interface (``0.0.0.0``, ``::``)."""
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False


def resolve(host: str) -> set[Address]:
    """Every address of ``host`` (an IP literal, or a name's A and AAAA answers); an IPv6 zone is
    dropped. OSError when a name does not resolve."""
    infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    return {_address(info[4][0]) for info in infos if isinstance(info[4][0], str)}


def interface_holding(host: str) -> str | None:
    """The name of this machine's network interface that answers on ``host`` (an address, or a name
    with at least one such answer), or None. Any 127.0.0.0/8 address is the loopback interface's. OSError
    when a name does not resolve."""
    import psutil

    wanted = resolve(host)
    for name, entries in psutil.net_if_addrs().items():
        held = [_address(e.address) for e in entries if e.family in (socket.AF_INET, socket.AF_INET6)]
        if any(_holds(address, w) for address in held for w in wanted):
            return name
    return None


def check_local(flag: str, host: str, why: str) -> None:
    """Nothing when ``host`` is on one of this machine's interfaces; else ValueError, one line naming
    ``flag`` and ``why`` the address must be this machine's. A wildcard is refused too (it is nobody's
    address to dial)."""
    if is_wildcard(host):
        raise ValueError(f"{flag} {host!r} is a wildcard; give this machine's address that {why}")
    try:
        found = interface_holding(host)
    except OSError as exc:
        raise ValueError(f"{flag} {host!r} does not resolve: {exc}") from None
    if found is None:
        raise ValueError(f"{flag} {host!r} is on no network interface of this machine; give one of its addresses "
                         f"({why})")


def _holds(address: Address, wanted: Address) -> bool:
    """Whether an interface with ``address`` answers on ``wanted``: the same address, or both loopback
    (the loopback interface lists 127.0.0.1 but answers on all of 127.0.0.0/8)."""
    return address == wanted or (address.version == wanted.version and address.is_loopback and wanted.is_loopback)


def _address(text: str) -> Address:
    """An address without its IPv6 zone (``fe80::1%eth0``)."""
    return ipaddress.ip_address(text.split("%", 1)[0])
