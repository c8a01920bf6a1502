"""Encodes the images of a step's new prompts so that one prompt's bad image fails only that prompt.

Called by ``Engine.step`` on the engine thread with the model's vision encoder, with each prompt's
images to encode (all of them, or with prefix caching those not wholly in its cached prefix). All
images go to the encoder in one call; if that raises, each prompt's images are encoded in a call of
their own, so the error lands on the prompt that caused it. A prompt whose embeddings do not fill
exactly its image placeholders (the encoder disagrees with the image processor) fails too, by name.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from stages.engine.multimodal import ImageEmbedding, ImageInput

log = logging.getLogger(__name__)
Encoder = Callable[[list[ImageInput]], list[ImageEmbedding]]


def encode_prompts(encode: Encoder, prompts: list[list[ImageInput]]) -> list[list[ImageEmbedding] | str]:
    """Per prompt's images (in order): their embeddings, or why they could not be had. Never raises
    for a failure of the encoder."""
    try:
        return _encode(encode, prompts)
    except Exception as exc:
        if len(prompts) > 1:
            log.warning("encoding the images of %d prompts failed (%s: %s); encoding them one by one",
                        len(prompts), type(exc).__name__, exc)
    return [_encode_alone(encode, prompt) for prompt in prompts]


def _encode_alone(encode: Encoder, prompt: list[ImageInput]) -> list[ImageEmbedding] | str:
    try:
        return _encode(encode, [prompt])[0]
    except Exception as exc:
        return f"image encoding failed: {type(exc).__name__}: {exc}"


def _encode(encode: Encoder, prompts: list[list[ImageInput]]) -> list[list[ImageEmbedding] | str]:
    images = [image for prompt in prompts for image in prompt]
    embeddings = list(encode(images)) if images else []
    if len(embeddings) != len(images):
        raise RuntimeError(f"the vision encoder returned {len(embeddings)} embeddings for {len(images)} images")
    results: list[list[ImageEmbedding] | str] = []
    for prompt in prompts:
        mine, embeddings = embeddings[: len(prompt)], embeddings[len(prompt):]
        sizes = [(e.num_tokens, image.num_tokens) for e, image in zip(mine, prompt)]
        bad = next((i for i, (got, want) in enumerate(sizes) if got != want), None)
        results.append(mine if bad is None else
                       f"image {bad} was encoded to {sizes[bad][0]} tokens but fills {sizes[bad][1]} placeholders")
    return results
