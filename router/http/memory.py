"""Giving back the memory of a large request body once its request is done.

A failed or cancelled attempt leaves reference cycles: an exception stored in a task and re-raised
from a frame that holds the task, the request and its connection holding the exception that
cancelled them. Their frames hold the plan and its bodies, and only Python's cyclic collector
frees them; its full collections are rare, so a 64 MiB body sent to a prefill and a decode could
keep ~3x its size resident indefinitely. After a request whose body was at least
``COLLECT_AFTER_BYTES``, a full collection is run shortly after the answer, once the tasks the
attempt cancelled have ended; it costs milliseconds, small next to reading, parsing and sending such
a body.
"""

from __future__ import annotations

import asyncio
import gc

from router.http import Handler, Request, Response, StreamResponse

COLLECT_AFTER_BYTES = 8 << 20
COLLECT_DELAY_S = (0.25, 2.0)  # after the answer: cancelled tasks end within an event-loop turn or two


def collect_after_large_bodies(handler: Handler) -> Handler:
    """``handler``, followed by full collections after a body of ``COLLECT_AFTER_BYTES`` or more."""
    async def collecting(request: Request) -> Response | StreamResponse:
        try:
            return await handler(request)
        finally:
            if (request.content_length or 0) >= COLLECT_AFTER_BYTES:
                loop = asyncio.get_running_loop()
                for delay in COLLECT_DELAY_S:
                    loop.call_later(delay, gc.collect)

    return collecting
