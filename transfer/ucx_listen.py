"""Where NIXL's UCX listens: the network interface that holds ``--transfer-host``.

UCX's TCP transport listens on the address of every network interface it uses, and it can be given
interfaces (``UCX_NET_DEVICES``), never an address. So with protocol "tcp" and no ``device``, the NIXL
backend (``transfer/nixl.py``) passes ``ucx_params(config)``: UCX pinned to the interface that holds
``config.host``. Without torch or NIXL, so a server's config checks it before loading anything.
"""

from __future__ import annotations

from process.addresses import interface_holding
from transfer.base import TransferConfig


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
    try:
        name = interface_holding(host)
    except OSError as exc:
        raise ValueError(f"--transfer-host {host!r} does not resolve: {exc}") from exc
    if name is None:
        raise ValueError(f"--transfer-host {host!r} is on no network interface of this machine; give one of its "
                         f"addresses (NIXL's UCX listens on that interface only)")
    return name
