"""An EPD prefill room's image embeddings on their way into its engine request, for a prefill that
computes the prompt while the images are encoded (``--prefill-overlap``, on by default).

The room's reader (``ImageInputs.fill`` with ``arrived=feed.arrived``) starts when the HTTP request
comes, before the room is paired and before its request is in the engine; what lands before then is
kept, and handed over when the room's runner ``attach``es the engine request (everything kept, in
prompt order, then each later one as it lands). All on the event loop.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from stages.engine.multimodal import ImageEmbedding

Provide = Callable[[int, ImageEmbedding], Awaitable[object]]  # (image index, its embedding) -> into the engine


class InputFeed:
    """Embeddings kept until ``attach``, then passed straight on."""

    def __init__(self) -> None:
        self._kept: dict[int, ImageEmbedding] = {}
        self._provide: Provide | None = None

    async def arrived(self, indexes: list[int], embedding: ImageEmbedding) -> None:
        """The embedding of the images at ``indexes`` (one key) was read (``ImageInputs.fill``'s ``arrived``)."""
        for index in indexes:
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
