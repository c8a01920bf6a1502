"""A process's start id: ``instance_id`` in every server's ``/server_info`` (the router's and each
stage's), so whoever started a server can tell its answer from another process's on the same port.

A starter (``stage up``, ``stages.launch.stack``) gives each child a fresh ``new_instance_id()`` in the
``EPD_INSTANCE_ID`` environment variable and checks that the server answering on the child's port
reports it (``stages.launch.health``). ``INSTANCE_ID`` is this process's: that variable when set, else
random, fresh at every process start. The stage servers report it; the router gets it from the CLI
in its config (``RouterConfig.instance_id``: the router imports nothing of ``stages``).
"""

from __future__ import annotations

import os
import secrets

INSTANCE_ENV = "EPD_INSTANCE_ID"


def new_instance_id() -> str:
    """A fresh random id (16 hex digits)."""
    return secrets.token_hex(8)


INSTANCE_ID = os.environ.get(INSTANCE_ENV) or new_instance_id()
