"""What a stage process holds, for ``/server_info``: the parameters it loaded and its resident memory."""

from __future__ import annotations

import os
from typing import Any

from router.instance import INSTANCE_ID


def rss_bytes() -> int:
    """Resident set size of this process now (Linux ``/proc/self/statm``)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def model_info(adapter: Any, images: str) -> dict:
    """The ``/server_info`` fields every model-running role reports: the halves it loaded
    (``adapter.parts``), their parameter count, how it takes images, its resident memory now, and this
    process's start id (``router.instance``)."""
    return {"parts": list(adapter.parts), "num_parameters": adapter.num_parameters, "images": images,
            "rss_bytes": rss_bytes(), "instance_id": INSTANCE_ID}
