"""An EPD prefill room's image embeddings on their way into its engine request, for a prefill that
computes the prompt while the images are encoded (``--prefill-overlap``, on by default).

The room's reader (``ImageInputs.fill`` with ``arrived=feed.arrived``) starts when the HTTP request
comes, before the room is paired and before its request is in the engine; what lands before then is
kept, and handed over when the room's runner ``attach``es the engine request (everything kept, in
prompt order, then each later one as it lands). All on the event loop.

Images the prefix cache already holds: the reader skips the images whose placeholders lie wholly inside
the prefix the cache held for the prompt when it came (``covered``: a hint, ``Engine.prefix_hint``). Once
the request is admitted, its runner asks which pending images it needs (``Engine.admitted_needs``); any
covered one among them (its blocks were evicted meanwhile) is read then (``read_late``). The covered
images never read are counted (``skipped``).

``feed_engine`` is the room's side of it: the task its runner starts beside the engine request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING

from stages.disagg.errors import DisaggError
from stages.engine.multimodal import ImageEmbedding

if TYPE_CHECKING:
    from stages.engine.async_engine import AsyncEngine

log = logging.getLogger(__name__)
ADMISSION_POLL_S = 0.002  # how often a request whose images the prefix cache covered asks if it is admitted

Provide = Callable[[int, ImageEmbedding], Awaitable[object]]  # (image index, its embedding) -> into the engine
Read = Callable[[Collection[int]], Awaitable[None]]  # read the references at these indexes, through ``arrived``


class InputFeed:
    """Embeddings kept until ``attach``, then passed straight on; ``covered``: the indexes the first
    read leaves out; ``read``: reads more of them later."""

    def __init__(self, covered: frozenset[int] = frozenset(), read: Read | None = None,
                 skipped: Callable[[int], None] | None = None) -> None:
        self.covered, self._read, self._skipped = covered, read, skipped
        self._late: set[int] = set()  # covered images read after all
        self._kept: dict[int, ImageEmbedding] = {}
        self._provide: Provide | None = None

    async def arrived(self, index: int, embedding: ImageEmbedding) -> None:
        """Image ``index``'s embedding was read (``ImageInputs.fill``'s ``arrived``)."""
        if self._provide is None:
            self._kept[index] = embedding
        else:
            await self._provide(index, embedding)

    async def attach(self, provide: Provide) -> None:
        """From now on each embedding goes to ``provide``; the ones kept go first, in prompt order."""
        self._provide = provide
        kept, self._kept = sorted(self._kept.items()), {}
        for index, embedding in kept:
            await provide(index, embedding)

    async def read_late(self, needed: Collection[int]) -> None:
        """Read the covered images among ``needed`` (the admitted request's). Raises what the read
        raises (DisaggError)."""
        late = sorted(set(needed) & self.covered)
        self._late.update(late)
        if late and self._read is not None:
            await self._read(late)

    def finish(self) -> None:
        """The room's request is done: count the covered images never read (``skipped``)."""
        if self._skipped is not None and len(self.covered) > len(self._late):
            self._skipped(len(self.covered) - len(self._late))


@dataclass(frozen=True)
class Fed:
    """How a room's feeding ended: ``error``, a late read's failure (the request was aborted; the room
    fails with it); else, when every embedding was read and handed in, ``overlap_s`` (how long the
    request had been in the engine by then) and ``computed_tokens`` (the most prompt tokens it had
    computed when an embedding came): the timeline's ``embeddings_ready``. Neither: the request was
    aborted for another reason (the inputs failed, the engine refused an embedding)."""

    error: DisaggError | None = None
    overlap_s: float | None = None
    computed_tokens: int = 0


async def feed_engine(feed: InputFeed, inputs: asyncio.Task, engine: AsyncEngine, request_id: str) -> Fed:
    """Hand a room's embeddings to its engine request ``request_id`` as they land, and once it is
    admitted read the covered images it needs after all (``read_late``); on any failure, abort the
    request (its stream ends; the caller raises the read's or the inputs' error). Started by the room's
    runner right after it queued the request, so the engine takes the request before any embedding."""
    started, computed = time.monotonic(), [0]

    async def provide(index: int, embedding: ImageEmbedding) -> None:
        had = await engine.call(lambda e: e.provide(request_id, index, embedding))
        computed[0] = max(computed[0], had or 0)

    try:
        await feed.attach(provide)
        if feed.covered:
            await feed.read_late(await _admitted_needs(engine, request_id))
    except DisaggError as exc:  # a late read failed: the room fails with its error
        engine.abort(request_id)
        return Fed(error=exc)
    except Exception:  # the engine refused an embedding (or is gone): the request cannot finish
        log.exception("%s: could not hand its embeddings to the engine", request_id)
        engine.abort(request_id)
        return Fed()
    await asyncio.wait({inputs})
    if inputs.cancelled() or inputs.exception() is not None:
        engine.abort(request_id)
        return Fed()
    return Fed(overlap_s=round(time.monotonic() - started, 6), computed_tokens=computed[0])


async def _admitted_needs(engine: AsyncEngine, request_id: str) -> list[int]:
    """Once the engine has admitted ``request_id`` (polled every ``ADMISSION_POLL_S``): the pending
    images it needs (``Engine.admitted_needs``; [] if it is gone)."""
    while (needs := await engine.call(lambda e: e.admitted_needs(request_id))) is None:
        await asyncio.sleep(ADMISSION_POLL_S)
    return needs
