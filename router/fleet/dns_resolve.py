"""Resolving a ``--discover`` source (``router.fleet.dns_source``) to worker URLs, with dnspython's asyncio
resolver. The only module of the router that talks DNS; the loop around it is ``router.fleet.dns_watch``.

Contract: ``resolve`` answers the set of worker URLs a source names now (possibly empty: the name
exists but has no address), or raises ``DnsFailure`` whose ``kind`` is one of ``KINDS``. It is
all-or-nothing: a failure of any query it needs (A or AAAA, an SRV target's addresses) fails the
whole answer, so a half answer never looks like workers that left. Each query is bounded by the
resolver's lifetime (``make_resolver``'s ``timeout_s``); an SRV source's targets are resolved
concurrently, so one answer takes at most about twice that.
"""

from __future__ import annotations

import asyncio

import dns.asyncresolver
import dns.exception
import dns.resolver

from router.fleet.dns_source import DnsSource, worker_url

KINDS = ("timeout", "nxdomain", "servfail", "error")


class DnsFailure(Exception):
    """No usable answer; ``kind``: timeout (no nameserver answered in time), nxdomain (the name does
    not exist), servfail (every nameserver failed or refused), error (anything else dnspython raised)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def make_resolver(nameserver: tuple[str, int] | None, timeout_s: float) -> dns.asyncresolver.Resolver:
    """A resolver asking ``nameserver`` (ip, port), or the system's (``/etc/resolv.conf``) when None;
    each query gives up after ``timeout_s``."""
    if nameserver is None:
        resolver = dns.asyncresolver.Resolver()
        resolver.use_search_by_default = True  # a short name (a Service in the pod's namespace) as libc finds it
    else:
        resolver = dns.asyncresolver.Resolver(configure=False)
        resolver.nameservers = [nameserver[0]]
        resolver.port = nameserver[1]
    resolver.timeout = resolver.lifetime = timeout_s
    return resolver


async def resolve(resolver: dns.asyncresolver.Resolver, source: DnsSource) -> frozenset[str]:
    """The worker URLs ``source`` names now; ``DnsFailure`` if there is no usable answer."""
    if source.scheme == "dns":
        assert source.port is not None
        return frozenset(worker_url(a, source.port) for a in await _addresses(resolver, source.name))
    records = await _query(resolver, source.name, "SRV")
    targets = sorted({(r.target.to_text(), r.port) for r in records})
    found = await asyncio.gather(*(_addresses(resolver, target) for target, _ in targets))
    return frozenset(worker_url(a, port) for (_, port), addresses in zip(targets, found) for a in addresses)


async def _addresses(resolver: dns.asyncresolver.Resolver, name: str) -> list[str]:
    """Every A and AAAA address of ``name`` (none if it has neither)."""
    v4, v6 = await asyncio.gather(_query(resolver, name, "A"), _query(resolver, name, "AAAA"))
    return [r.address for r in (*v4, *v6)]


async def _query(resolver: dns.asyncresolver.Resolver, name: str, rdtype: str) -> list:
    """The records of one type (none when the name has no such record); ``DnsFailure`` otherwise."""
    try:
        answer = await resolver.resolve(name, rdtype, raise_on_no_answer=False)
    except dns.resolver.NXDOMAIN:
        raise DnsFailure("nxdomain", f"{name} does not exist (NXDOMAIN)") from None
    except dns.exception.Timeout as exc:
        raise DnsFailure("timeout", f"{rdtype} {name}: no answer in time ({exc})") from None
    except dns.resolver.NoNameservers as exc:
        raise DnsFailure("servfail", f"{rdtype} {name}: {exc}") from None
    except dns.exception.DNSException as exc:
        raise DnsFailure("error", f"{rdtype} {name}: {type(exc).__name__}: {exc}") from None
    return list(answer.rrset) if answer.rrset is not None else []
