"""Typed values that carry a prompt and its images through the engine and between stages."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

import torch

from contract.video import VideoPlan


@dataclass(frozen=True)
class ImageInput:
    """One image (or one video's sampled frames) after the model's processor: what the vision tower eats.

    ``pixel_values``: Qwen-VL: [patches, patch_dim] with ``grid_thw`` (t, h, w) in patches (t > 1: a video);
    LLaVA: [3, H, W] with ``grid_thw`` None. ``num_tokens``: placeholder tokens it fills in the prompt.

    ``load``: set on a ``deferred`` image only (its pixels not made yet: a PIXELS stage found its
    placeholders in the cached prefix, ``stages.api.chat``); ``loaded`` makes them.
    """

    pixel_values: torch.Tensor
    grid_thw: tuple[int, int, int] | None
    num_tokens: int
    load: Callable[[], ImageInput] | None = field(default=None, compare=False, repr=False)

    @classmethod
    def deferred(cls, num_tokens: int, grid_thw: tuple[int, int, int] | None,
                 load: Callable[[], ImageInput]) -> ImageInput:
        """An image whose pixels are not made yet (no pixel decoded nor preprocessed): its placeholder
        count and grid (from its size), and ``load``, which decodes and preprocesses it when called."""
        return cls(torch.empty(0), grid_thw, num_tokens, load)

    @property
    def is_deferred(self) -> bool:
        return self.load is not None

    def loaded(self) -> ImageInput:
        """This image with its pixels: itself, or for a deferred one what ``load()`` makes (whatever it
        raises passes). ValueError if that fills another count of placeholders or has another grid than
        the deferred image claimed (the prompt was built from them)."""
        if self.load is None:
            return self
        image = self.load()
        if (image.num_tokens, image.grid_thw) != (self.num_tokens, self.grid_thw):
            raise ValueError(f"the image's pixels fill {image.num_tokens} placeholder tokens with grid "
                             f"{image.grid_thw}, its size claimed {self.num_tokens} with grid {self.grid_thw}")
        return image


@dataclass(frozen=True)
class ImageEmbedding:
    """One image after the vision tower and projector: [num_tokens, hidden] (plus Qwen3-VL's
    deepstack features [num_deepstack_layers, num_tokens, hidden], which travel with it)."""

    embeds: torch.Tensor
    grid_thw: tuple[int, int, int] | None
    deepstack: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.embeds.shape[0]

    @classmethod
    def skipped(cls, image: ImageInput) -> ImageEmbedding:
        """The stand-in of an image not encoded because its placeholders lie wholly in a prompt's
        cached prefix (prefix caching): its token count and grid, no features (``[num_tokens, 0]``).
        No step reads its rows: ``slice_embeddings`` only counts them."""
        return cls(torch.empty((image.num_tokens, 0), device="cpu"), image.grid_thw)

    @classmethod
    def pending(cls, num_tokens: int, grid_thw: tuple[int, int, int] | None) -> ImageEmbedding:
        """The stand-in of an image whose embedding is still coming (an EPD prefill that computes the
        prompt while its images are encoded: ``Engine.add_request(awaiting=True)``)."""
        return cls(torch.empty((num_tokens, 0), device="cpu"), grid_thw)

    @property
    def stand_in(self) -> bool:
        """A ``skipped`` or ``pending`` stand-in (no features), not an embedding."""
        return self.embeds.shape[-1] == 0


@dataclass
class Prompt:
    """Token ids with image placeholders already expanded, and what fills them.

    An "image" below is any visual item of the prompt, in prompt order: an image or a video. A video is
    one item whose placeholders are the model's video token (Qwen3-VL writes them frame by frame, with
    timestamps between: its placeholders need not be contiguous); ``videos[i]`` is item i's
    ``contract.video.VideoPlan`` (None: an image), or ``videos`` is empty when the prompt has no video.

    ``image_tokens[i]``: the placeholder tokens image i fills (set by the prompt builder from the
    pixels or from the image's size). Per image, either ``images`` (pixels, to encode in this
    process), ``embeddings`` (encoded elsewhere), or neither (a decode server: the prompt's KV comes
    from the prefill). ``image_grids`` is all prefill needs for M-RoPE positions.

    ``image_keys``: each image's content key (``cache.keys``), set by whoever built the prompt (from
    the image's bytes, or the reference's key in EPD); prefix caching hashes them into the blocks the
    image's placeholders fall in. None: unknown, and no block holding an image token is cached."""

    token_ids: list[int]
    image_tokens: list[int] = field(default_factory=list)
    images: list[ImageInput] = field(default_factory=list)
    embeddings: list[ImageEmbedding] | None = None
    image_keys: list[str] | None = None
    videos: list[VideoPlan | None] = field(default_factory=list)

    @property
    def num_images(self) -> int:
        return len(self.image_tokens)

    @property
    def video_plans(self) -> list[VideoPlan | None]:
        """One entry per item: its plan, None for an image."""
        return self.videos or [None] * self.num_images

    @property
    def image_grids(self) -> list[tuple[int, int, int] | None]:
        source = self.embeddings if self.embeddings is not None else self.images
        return [item.grid_thw for item in source]

    def check_images(self, media_token_ids: Collection[int], prefill: bool) -> None:
        """ValueError unless the placeholders (``media_token_ids``: the image and video tokens) are exactly
        ``image_tokens`` and, for a prompt to ``prefill`` here, its pixels or embeddings fill them item by
        item."""
        if self.videos and len(self.videos) != len(self.image_tokens):
            raise ValueError(f"prompt has {len(self.image_tokens)} images and videos but {len(self.videos)} video slots")
        placeholders = sum(1 for token in self.token_ids if token in media_token_ids)
        if placeholders != sum(self.image_tokens):
            raise ValueError(f"prompt has {placeholders} image placeholder tokens but its images fill "
                             f"{sum(self.image_tokens)}")
        fillers: Sequence[ImageEmbedding | ImageInput] = self.embeddings if self.embeddings is not None else self.images
        if not prefill and not fillers:
            return
        if len(fillers) != len(self.image_tokens):
            raise ValueError(f"prompt has {len(self.image_tokens)} images but {len(fillers)} "
                             f"{'embeddings' if self.embeddings is not None else 'preprocessed images'}")
        for i, (item, want) in enumerate(zip(fillers, self.image_tokens)):
            if item.num_tokens != want:
                raise ValueError(f"image {i} fills {want} placeholder tokens but its "
                                 f"{'embedding has' if self.embeddings is not None else 'pixels make'} "
                                 f"{item.num_tokens}")


def slice_embeddings(embeddings: list[ImageEmbedding], first: int, last: int) -> list[ImageEmbedding]:
    """The rows ``[first, last)`` of the images' embeddings laid end to end (image token k of the
    prompt is row k), as one piece per image they touch: what a prefill chunk whose image tokens are
    the prompt's k = ``first`` .. ``last - 1`` splices in. Images wholly inside come back as they are."""
    pieces, offset = [], 0
    for embedding in embeddings:
        lo, hi = max(first - offset, 0), min(last - offset, embedding.num_tokens)
        offset += embedding.num_tokens
        if lo >= hi:
            continue
        if (lo, hi) == (0, embedding.num_tokens):
            pieces.append(embedding)
            continue
        deepstack = None if embedding.deepstack is None else embedding.deepstack[:, lo:hi]
        pieces.append(ImageEmbedding(embedding.embeds[lo:hi], embedding.grid_thw, deepstack))
    return pieces
