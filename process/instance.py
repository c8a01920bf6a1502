"""A process's start id: ``instance_id`` in every server's ``/server_info`` (the router's and each
stage's), so whoever started a server can tell its answer from another process's on the same port.

A starter (``stage up``, ``stages.launch.stack``) gives each child a fresh ``new_instance_id()`` in the
``EPD_INSTANCE_ID`` environment variable and checks that the server answering on the child's port
reports it (``stages.launch.health``). ``instance_id()`` is this process's: that variable when set, else
random, fresh in every process: drawn at its first call, and drawn again in a forked child (a server
forked from a pre-imported interpreter, as the tests do, is a process of its own). The stage servers report it; the router gets it from the CLI
in its config (``RouterConfig.instance_id``: the router imports nothing of ``stages``).
"""

from __future__ import annotations

import functools
import os
import secrets

INSTANCE_ENV = "EPD_INSTANCE_ID"


def new_instance_id() -> str:
    """A fresh random id (16 hex digits)."""
    return secrets.token_hex(8)


@functools.cache
def instance_id() -> str:
    """This process's start id: ``EPD_INSTANCE_ID`` when set, else a fresh random one, the same for every call in this process."""
    return os.environ.get(INSTANCE_ENV) or new_instance_id()


os.register_at_fork(after_in_child=instance_id.cache_clear)
