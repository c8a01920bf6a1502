"""The ``engine.*`` fault points, plugged into the ``AsyncEngine``'s ``before_step`` hook."""

from __future__ import annotations

import time
from collections.abc import Callable

from stages.faults.points import Faults


def engine_hook(faults: Faults) -> Callable[[bool], None]:
    """The ``before_step`` hook of a server's ``AsyncEngine``: runs the ``engine.*`` points on the
    engine thread, which calls it before each step (``busy``) and while idle. A crash may come either
    way; a stall only before a step, so it delays work that is there."""

    def before_step(busy: bool) -> None:
        if faults.take("engine.thread_crash"):
            raise RuntimeError("fault point engine.thread_crash")
        stall = faults.take("engine.stall") if busy else None
        if stall is not None:
            time.sleep(stall.delay_s)

    return before_step
