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
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection

from stages.engine.multimodal import ImageEmbedding

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
