"""Pin a started ``Stack`` to the cores of ``Pinning``: every thread of every process of each child.

Called by ``session.py`` once the stack is healthy (the models load unpinned, which only makes start-up
faster). Linux sets affinity per thread, so each thread in ``/proc/PID/task`` is pinned; threads made
later inherit the affinity of the thread that makes them, which is pinned by then. A child leads its own
process group (``process.children``), so anything it forked is found by its group id.
"""

from __future__ import annotations

from bench.common.pinning import pin_threads
from bench.common.proc import group_pids
from bench.compare.config import Pinning
from stages.launch.stack import Stack


def pin_stack(stack: Stack, pinning: Pinning) -> dict[str, dict]:
    """Pin each child (by its role) and the embedded Redis; returns role -> {"pids", "cores"} for the
    JSON. Raises OSError if a core does not exist on this machine (``--pin``)."""
    placed: dict[str, dict] = {}
    groups = [(child.spec.role, group_pids(child.proc.pid)) for child in stack.children]
    if stack.redis is not None and stack.redis.process is not None:
        groups.append(("redis", [stack.redis.process.pid]))
    for role, pids in groups:
        cores = pinning.of(role)
        for pid in pids:
            pin_threads(pid, cores)
        placed[role] = {"pids": pids, "cores": list(cores)}
    return placed
