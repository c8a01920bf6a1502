"""What a stage process holds, for ``/server_info``: its resident memory."""

from __future__ import annotations

import os


def rss_bytes() -> int:
    """Resident set size of this process now (Linux ``/proc/self/statm``)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
