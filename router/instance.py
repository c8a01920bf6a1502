"""This process's start id: ``instance_id`` in every server's ``/server_info`` (the router's and each
stage's), so whoever started a server can tell its answer from another process's on the same port.

It is ``EPD_INSTANCE_ID`` when the starter sets it (``stage up`` gives each child its own and checks
that the server answering on the child's port reports it), else random, fresh at every process start.
"""

from __future__ import annotations

import os
import secrets

INSTANCE_ENV = "EPD_INSTANCE_ID"
INSTANCE_ID = os.environ.get(INSTANCE_ENV) or secrets.token_hex(8)
