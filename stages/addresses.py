"""A stage's addresses checked at start: every address it binds or hands out is one of its own.

A stage hands out addresses for others to dial: a prefill's bootstrap host (in ``/server_info``, which
the router passes to decodes), every disaggregated stage's transfer host (in its KV descriptor:
Mooncake's handshake address; NIXL pins UCX to that host's interface). ``check_addresses`` refuses,
before anything loads, any of them that is on none of this machine's network interfaces (a hostname
needs one local A or AAAA answer), naming the flag to change: a typo or another host's address would
otherwise surface only as a peer's dial timing out. A wildcard ``--host`` or ``--bootstrap-host`` is
allowed (the router then dials the stage by the host of its URL); a wildcard transfer host is refused
by ``TransferConfig``. Mooncake takes IPv4 only: its P2P handshake resolves peers over IPv4, so a
transfer host with no IPv4 address is refused for it (NIXL, the bootstrap and HTTP take IPv6).
"""

from __future__ import annotations

from stages.config import ServerConfig
from process.addresses import check_local, is_wildcard, resolve


def check_addresses(config: ServerConfig, transfer_flag: str = "--transfer-host") -> None:
    """Nothing when every address of ``config`` is this machine's; else ValueError, one line naming the
    flag. ``transfer_flag`` is the flag that set the transfer host (``--host`` when ``--transfer-host``
    was left to its default)."""
    if not is_wildcard(config.host):
        check_local("--host", config.host, "the HTTP server listens on it")
    disagg = config.disagg
    if disagg is None:
        return
    host = disagg.transfer_config.host
    check_local(transfer_flag, host, "peers dial it for the KV")
    if disagg.transfer == "mooncake" and not any(address.version == 4 for address in resolve(host)):
        raise ValueError(f"{transfer_flag} {host!r} has no IPv4 address, and Mooncake's handshake dials IPv4 only; "
                         "give an IPv4 --transfer-host (HTTP and the bootstrap may stay on IPv6) or use --transfer nixl")
    if config.role in ("prefill", "pd") and not is_wildcard(disagg.bootstrap_host):
        check_local("--bootstrap-host", disagg.bootstrap_host, "decodes dial it for the KV handshake")
