"""What every server process of ours does on its host, torch-free, below the router and the stages:

  ``ports``      bind a server's port first (``PortError`` names the flag), probe one, draw a free one
  ``instance``   a process's start id (``EPD_INSTANCE_ID``), published in every ``/server_info``
  ``secrets``    the Redis URL and the admin token from a flag, a file or the environment
  ``addresses``  ``host:port`` for IPv4 and IPv6, and whether an address is one of this host's
  ``children``   a child leading its own process group that dies with its starter; stopping one

It imports nothing of ours; the router, the stages, the cache, the transfer layer, the launcher and
the CLI all use it (docs/architecture.md).
"""
