"""Where NIXL's UCX listens: the network interface that holds ``--transfer-host``.

UCX's TCP transport listens on the address of every network interface it uses, and it can be given
interfaces (``UCX_NET_DEVICES``), never an address. So with protocol "tcp" and no ``device``, the NIXL
backend (``transfer/nixl.py``) passes ``ucx_params(config)``: UCX pinned to the interface that holds
``config.host``. Without torch or NIXL, so a server's config checks it before loading anything.
"""

from __future__ import annotations

import ipaddress
import socket

from transfer.base import TransferConfig

Address = ipaddress.IPv4Address | ipaddress.IPv6Address


def ucx_params(config: TransferConfig) -> dict[str, str]:
    """The NIXL UCX backend's parameters: ``device`` as ``ucx_devices``; for protocol "tcp" without one,
    ``NET_DEVICES`` = the interface of ``host`` (a ``UCX_NET_DEVICES`` in the environment still wins);
    "rdma" and "ucx" leave UCX its own choice. ValueError naming --transfer-host if no interface holds it."""
    if config.device:
        return {"ucx_devices": config.device}
    if config.protocol != "tcp":
        return {}
    return {"engine_config": f"NET_DEVICES={interface_of(config.host)}"}


def interface_of(host: str) -> str:
    """The name of this machine's network interface that holds ``host`` (an address, or a name resolved
    to one; any 127.0.0.0/8 or ::1 host is the loopback interface's). ValueError naming --transfer-host
    when none holds it."""
    import psutil  # here, not at the top: the CLI imports this module and stays fast (stage --help)

    try:
        wanted = {_address(info[4][0]) for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
                  if isinstance(info[4][0], str)}  # an IPv4 or IPv6 address; other families have none
    except OSError as exc:
        raise ValueError(f"--transfer-host {host!r} does not resolve: {exc}") from exc
    for name, addresses in psutil.net_if_addrs().items():
        held = [_address(a.address) for a in addresses if a.family in (socket.AF_INET, socket.AF_INET6)]
        if any(_holds(address, host_address) for address in held for host_address in wanted):
            return name
    raise ValueError(f"--transfer-host {host!r} is on no network interface of this machine; give one of its "
                     f"addresses (NIXL's UCX listens on that interface only)")


def _holds(address: Address, wanted: Address) -> bool:
    """Whether an interface with ``address`` answers on ``wanted``: the same address, or both loopback
    (the loopback interface lists 127.0.0.1 but answers on all of 127.0.0.0/8)."""
    return address == wanted or (address.version == wanted.version and address.is_loopback and wanted.is_loopback)


def _address(text: str) -> Address:
    """An address without its IPv6 zone (``fe80::1%eth0``)."""
    return ipaddress.ip_address(text.split("%", 1)[0])
