"""An EPD prefill's image inputs: the embeddings of a request's image and video references, read from the cache.

``ImageInputs.fill(prompt, refs)`` reads them for the prefill's room (``PrefillCoordinator``): whole,
awaited before its request enters the engine, or (``arrived``) each key handed on as soon as it is
read, so the engine computes the prompt up to the next image it still waits for (``stand_ins`` are the
prompt's embeddings meanwhile: ``ImageEmbedding.pending``). Either way a request whose embeddings are
not ready waits on its own and never holds up the prefill or decode of others. Per distinct key: ``EmbeddingCache.get``; on a miss
``wait_ready`` (woken when the key lands, within what is left of ``--embedding-timeout-s``). Every
entry is checked against what its reference implies (``check_embedding``) before it is used: a
mismatch is a miss, its entry is deleted, and the request fails; wrong data is never spliced in.

A video reference (``VideoRef``: key, probe, sampling) is read the same way under its key; what it
implies is its plan's (``contract.video.plan``): ``plan.num_tokens`` rows, grid ``plan.grid``.

Every failure is a ``DisaggError`` whose status the prefill answers, and whose message the decode
gets as the room's failure reason; one about an image (or a video) names its key in the ``image_key``
field (the router blames the encoder it sent that item to by this field, never by the message):

    503 cache_unavailable   Redis down, unreachable or slow past --cache-op-timeout-s (names Redis)
    400 image_not_cached    the key is neither cached nor being encoded (at once, no wait)
    502 encode_failed       the encode failed (``contract.claims``: the encoder reported a failure,
                            or died with the claim taken up: it lapsed)
    503 encode_abandoned    the encode ended as back-pressure (``contract.claims``: refused, cancelled,
                            its cache write refused or timed out, its claim lapsed before the encoder
                            took it up, ...): Retry-After: 1; a new try claims the key anew
    504 embedding_timeout   still being encoded at --embedding-timeout-s
    502 embedding_mismatch  the entry does not fit the reference or this model (deleted)
    400 invalid_video       a video reference whose probe and sampling make no plan
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from cache.errors import CacheUnavailable, EncodeAbandoned, EncodeFailed, NotPending, ReadyTimeout
from cache.store import CachedEmbedding, EmbeddingCache
from contract.claims import RETRY_AFTER_S, ClaimState, ended_status
from contract.errors import Code
from contract.video import VideoPlan
from stages.api.message_schemas import ImageRef
from stages.disagg.errors import DisaggError
from stages.engine.multimodal import ImageEmbedding, Prompt
from stages.engine.prefix_cache import covered_items
from stages.prompt import PromptBuilder

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EmbeddingShape:
    """What every embedding must look like for this model: rows of ``hidden_size`` (the language
    model's), plus ``deepstack_layers`` deepstack rows per token (Qwen3-VL; 0 for the others)."""

    hidden_size: int
    deepstack_layers: int


@dataclass(frozen=True)
class Expected:
    """What one reference implies: placeholder tokens and grid (from its width and height)."""

    num_tokens: int
    grid: tuple[int, int, int] | None


class VideoReference(Protocol):
    """A video reference as ``fill`` reads it (``stages.api.message_schemas.VideoRef``): its cache key and
    its plan (ValueError where its probe and sampling make none)."""

    @property
    def key(self) -> str: ...

    def plan(self) -> VideoPlan: ...


Refs = Sequence[tuple["ImageRef | VideoReference", str]]  # each reference and its param path, in prompt order
Arrived = Callable[[int, ImageEmbedding], Awaitable[None]]  # (the prompt's image index, its embedding)


class Mismatch(ValueError):
    """A cached entry that does not fit its reference or the model."""


def check_embedding(hit: CachedEmbedding, expected: Expected, shape: EmbeddingShape) -> ImageEmbedding:
    """The entry as an ``ImageEmbedding`` if it fits; ``Mismatch`` naming the first disagreement.
    Pure: checks the entry's token count and grid, and each tensor's name, shape and dtype."""
    entry, tensors = hit.entry, hit.tensors
    grid = list(expected.grid) if expected.grid is not None else []
    if entry.num_tokens != expected.num_tokens:
        raise Mismatch(f"the entry has {entry.num_tokens} tokens, the reference's size fills {expected.num_tokens}")
    if list(entry.image_grid) != grid:
        raise Mismatch(f"the entry's image grid is {list(entry.image_grid)}, the reference's size gives {grid}")
    names = {"embeds", "deepstack"} if shape.deepstack_layers else {"embeds"}
    if set(tensors) != names:
        raise Mismatch(f"the entry holds tensors {sorted(tensors)}, this model needs {sorted(names)}")
    _check_tensor("embeds", tensors["embeds"], [expected.num_tokens, shape.hidden_size])
    if shape.deepstack_layers:
        _check_tensor("deepstack", tensors["deepstack"], [shape.deepstack_layers, expected.num_tokens,
                                                          shape.hidden_size])
    return ImageEmbedding(tensors["embeds"], expected.grid, tensors.get("deepstack"))


def _check_tensor(name: str, tensor: torch.Tensor, want: list[int]) -> None:
    if list(tensor.shape) != want:
        raise Mismatch(f"tensor {name!r} has shape {list(tensor.shape)}, this model needs {want}")
    if not tensor.dtype.is_floating_point:
        raise Mismatch(f"tensor {name!r} has dtype {tensor.dtype}, not a floating-point type")


class ImageInputs:
    """The prefill's reader of the cache: what a reference implies comes from ``prompts``'s size rule
    (``num_image_tokens``, ``image_grid``). One object per server, used from its event loop."""

    def __init__(self, cache: EmbeddingCache, shape: EmbeddingShape, prompts: PromptBuilder, timeout_s: float,
                 skipped: Callable[[int], None] | None = None) -> None:
        self.cache = cache
        self.shape = shape
        self.prompts = prompts
        self.timeout_s = timeout_s
        self.skipped = skipped  # counts the images never read: the prefix cache held their KV

    def covered(self, prompt: Prompt, cached_tokens: int) -> frozenset[int]:
        """The indexes of the prompt's images whose placeholders lie wholly inside its first
        ``cached_tokens`` (a prefix hit: their KV is there, their embeddings are not needed)."""
        return covered_items(prompt.token_ids, self.prompts.adapter.media_token_ids, prompt.image_tokens,
                             cached_tokens)

    def stand_ins(self, refs: Refs) -> list[ImageEmbedding]:
        """Each reference's ``pending`` stand-in (the placeholders it fills and its grid), in order.
        DisaggError 400 for a video reference without a plan."""
        return [ImageEmbedding.pending(want.num_tokens, want.grid)
                for want in (self._expected(ref, param) for ref, param in refs)]

    async def fill(self, prompt: Prompt, refs: Refs, arrived: Arrived | None = None,
                   only: Collection[int] | None = None) -> None:
        """Read each reference's embedding (image or video; ``param``: its path in the request, for
        errors) from the cache, every distinct key at once: set ``prompt.embeddings`` once all are
        read, or with ``arrived``, hand each reference's embedding on as soon as its key is read and the
        entry checked against that reference (keys land in any order). ``only``: read just the
        references at these indexes (with ``arrived``). Raises DisaggError (module docstring) within
        ``timeout_s`` of the call; other keys' reads are cancelled when one fails."""
        deadline = time.monotonic() + self.timeout_s
        expected = [self._expected(ref, param) for ref, param in refs]  # a video ref without a plan: 400 first
        indexes: dict[str, list[int]] = {}
        for i, (ref, _) in enumerate(refs):
            if only is None or i in only:
                indexes.setdefault(ref.key, []).append(i)
        embeddings: list[ImageEmbedding | None] = [None] * len(refs)

        async def one(key: str, mine: list[int]) -> None:
            ref, param = refs[mine[0]]
            hit = await self._read(key, _Named(param, _kind(ref)), deadline)
            for i in mine:  # each reference of the key checked against what it implies
                embeddings[i] = embedding = await self._checked(hit, *refs[i], expected[i])
                if arrived is not None:
                    await arrived(i, embedding)

        try:
            async with asyncio.TaskGroup() as group:
                for key, mine in indexes.items():
                    group.create_task(one(key, mine))
        except BaseExceptionGroup as failed:
            raise _first(failed) from None
        if arrived is None:
            prompt.embeddings = [e for e in embeddings if e is not None]

    async def _checked(self, hit: CachedEmbedding, ref: ImageRef | VideoReference, param: str,
                       want: Expected) -> ImageEmbedding:
        """The entry as an embedding if it fits ``ref``; else it is dropped and the request fails (502)."""
        try:
            return check_embedding(hit, want, self.shape)
        except Mismatch as exc:
            await self._drop(ref.key)
            size = "width and height" if isinstance(ref, ImageRef) else "probe and sampling"
            raise DisaggError(502, f"The cached embedding of {_kind(ref)} {ref.key} does not fit this request: "
                              f"{exc}; the entry was dropped. Check the reference's {size}, and that the "
                              "encoder serves the same model as this prefill.", Code.EMBEDDING_MISMATCH,
                              param, image_key=ref.key) from None

    def _expected(self, ref: ImageRef | VideoReference, param: str) -> Expected:
        """What ``ref`` implies: an image's by the size rule, a video's by its plan."""
        if isinstance(ref, ImageRef):
            return Expected(self.prompts.num_image_tokens(ref.width, ref.height),
                            self.prompts.image_grid(ref.width, ref.height))
        try:
            plan = ref.plan()
        except (TypeError, ValueError) as exc:
            raise DisaggError(400, f"The video reference {ref.key} makes no sampling plan: {exc}", Code.INVALID_VIDEO,
                              param, image_key=ref.key) from None
        return Expected(plan.num_tokens, plan.grid)

    async def _read(self, key: str, named: _Named, deadline: float) -> CachedEmbedding:
        param, kind, what = named.param, named.kind, named.kind.capitalize()
        try:
            hit = await self.cache.get(key)
            if hit is None:
                hit = await self.cache.wait_ready(key, max(0.0, deadline - time.monotonic()))
        except CacheUnavailable as exc:
            raise DisaggError(503, f"The embedding cache is unavailable: {exc}", Code.CACHE_UNAVAILABLE) from None
        except NotPending:
            raise DisaggError(400, f"{what} {key} is not in the embedding cache and no encoder is encoding it: send "
                              "it to an encoder first (it may also have been evicted since).", Code.IMAGE_NOT_CACHED,
                              f"{param}.key", image_key=key) from None
        except EncodeAbandoned as exc:
            raise DisaggError(ended_status(ClaimState.Abandoned), f"The encode of {kind} {key} that this request "
                              f"waited for was abandoned: {exc.reason}. Nothing is wrong with the {kind}; retry after "
                              f"{RETRY_AFTER_S} s.", Code.ENCODE_ABANDONED, param, image_key=key,
                              retry_after_s=RETRY_AFTER_S) from None
        except EncodeFailed as exc:
            raise DisaggError(ended_status(ClaimState.Failed), f"The encoder failed on {kind} {key}: {exc.reason}",
                              Code.ENCODE_FAILED, param, image_key=key) from None
        except ReadyTimeout:
            raise DisaggError(504, f"{what} {key} was still being encoded after {self.timeout_s:g} s "
                              "(--embedding-timeout-s).", Code.EMBEDDING_TIMEOUT, param, image_key=key) from None
        return hit

    async def _drop(self, key: str) -> None:
        try:
            await self.cache.delete(key)
        except CacheUnavailable as exc:
            log.warning("could not drop the mismatched entry of image %s: %s", key, exc)


@dataclass(frozen=True)
class _Named:
    """How errors name one key: the path of its first reference, and "image" or "video"."""

    param: str
    kind: str


def _kind(ref: ImageRef | VideoReference) -> str:
    return "image" if isinstance(ref, ImageRef) else "video"


def _first(group: BaseExceptionGroup) -> BaseException:
    """The error to answer with: the first DisaggError in the group, else the group itself."""
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            return _first(exc)
        if isinstance(exc, DisaggError):
            return exc
    return group
