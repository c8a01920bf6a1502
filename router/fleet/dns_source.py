"""What a ``--discover`` flag names, and the pure arithmetic of following it by DNS. No I/O: the
resolving is ``router.fleet.dns_resolve``, the loop that applies the changes ``router.fleet.dns_watch``. (Not to
be confused with ``router.fleet.discovery``: the workers' info and health checks.)

    --discover ROLE=dns://NAME:PORT   every A/AAAA address of NAME is a worker at http://ADDR:PORT
    --discover ROLE=dns+srv://NAME    every SRV record of NAME (target, port) is a worker at
                                      http://ADDR:PORT for each A/AAAA address ADDR of its target

Contract of ``plan``: an answer with no address changes nothing (a name that had answers keeps its
last answer: the router never drops every worker of a source because DNS blinked or a Service
briefly had no ready endpoint); otherwise an address new to the source is admitted, a worker the
answer no longer names is drained (then removed by the watcher once idle), and one drained by the
source that is named again is resumed. A URL held by another source (a static flag, the admin API,
another ``--discover``) is never admitted twice.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Collection
from dataclasses import dataclass
from urllib.parse import urlsplit

SCHEMES = ("dns", "dns+srv")
DNS_PORT = 53


@dataclass(frozen=True)
class DnsSource:
    """One ``--discover`` entry: the role its workers take, and the name (and port) they are found by."""

    role: str
    scheme: str  # "dns" (A/AAAA) or "dns+srv" (SRV)
    name: str
    port: int | None  # dns: the port of every address; dns+srv: None (each record carries its own)

    @property
    def label(self) -> str:
        """How the admin API and the logs name this source (``dns://NAME:PORT``, ``dns+srv://NAME``)."""
        return f"{self.scheme}://{self.name}" + (f":{self.port}" if self.port is not None else "")


def parse_discover(text: str, roles: Collection[str]) -> DnsSource:
    """``ROLE=dns://NAME:PORT`` or ``ROLE=dns+srv://NAME`` as a ``DnsSource``; ValueError names ``--discover``."""
    usage = f"--discover takes ROLE=dns://NAME:PORT or ROLE=dns+srv://NAME, got {text!r}"
    role, sep, uri = text.partition("=")
    if not sep or not role:
        raise ValueError(usage)
    if role not in roles:
        raise ValueError(f"--discover: the role must be one of {', '.join(roles)}, got {role!r} in {text!r}")
    scheme, sep, rest = uri.partition("://")
    if not sep or scheme not in SCHEMES:
        raise ValueError(usage)
    try:
        parts = urlsplit(f"dns://{rest}")
        port = parts.port
    except ValueError:
        raise ValueError(f"--discover: bad port in {text!r}") from None
    name = parts.hostname or ""
    if not name or parts.path or parts.query or parts.fragment or parts.username or parts.password:
        raise ValueError(usage)
    if scheme == "dns" and (port is None or port == 0):
        raise ValueError(f"--discover {role}=dns://NAME:PORT needs the workers' port (1-65535), got {text!r}")
    if scheme == "dns+srv" and port is not None:
        raise ValueError(f"--discover {role}=dns+srv://NAME takes no port (each SRV record has its own), got {text!r}")
    return DnsSource(role, scheme, name, port)


def parse_nameserver(text: str) -> tuple[str, int]:
    """``--discover-nameserver`` ``IP``, ``IP:PORT`` or ``[IPV6]:PORT`` as (ip, port); ValueError names the flag."""
    usage = f"--discover-nameserver takes IP[:PORT] (an IPv6 address bracketed with a port), got {text!r}"
    try:
        ipaddress.ip_address(text)
        return text, DNS_PORT
    except ValueError:
        pass
    try:
        parts = urlsplit(f"dns://{text}")
        host, port = parts.hostname or "", parts.port
        ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(usage) from None
    if parts.path or port is None or port == 0:
        raise ValueError(usage)
    return host, port


def worker_url(address: str, port: int) -> str:
    """``http://ADDR:PORT``, an IPv6 address bracketed."""
    return f"http://[{address}]:{port}" if ":" in address else f"http://{address}:{port}"


@dataclass(frozen=True)
class Changes:
    """What one answer asks of a source's workers, each list sorted: URLs to admit, to drain, to resume."""

    add: tuple[str, ...] = ()
    drain: tuple[str, ...] = ()
    resume: tuple[str, ...] = ()


def plan(answer: Collection[str], serving: Collection[str], draining: Collection[str],
         taken: Collection[str] = ()) -> Changes:
    """The changes that make a source's workers follow ``answer`` (the URLs of its latest successful
    answer). ``serving``: the source's workers it has not drained; ``draining``: those it drained
    (still in the registry); ``taken``: URLs of workers from elsewhere. See the module docstring."""
    now = frozenset(answer)
    if not now:
        return Changes()
    serving, draining = frozenset(serving), frozenset(draining)
    return Changes(add=tuple(sorted(now - serving - draining - frozenset(taken))),
                   drain=tuple(sorted(serving - now)), resume=tuple(sorted(draining & now)))
