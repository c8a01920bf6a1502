"""Encodes the images of a step's new prompts so that one prompt's bad image fails only that prompt.

Called by ``Engine.step`` on the engine thread (``encode_missing``) with the model's vision encoder:
each prompt's images to encode are all of them, or with prefix caching those not wholly in its
cached prefix (those get ``ImageEmbedding.skipped`` stand-ins, encoded after all if a recompute finds
less of the prompt cached). An image to encode that came ``deferred`` (``ImageInput.deferred``: a
PIXELS stage left its pixels unmade because its placeholders were in the cached prefix when the
request came, and the hint went stale) is decoded and preprocessed first, here, on the engine thread:
rare, and a failure fails that request alone. All
images go to the encoder in one call; if that raises, each prompt's images are encoded in a call of
their own, so the error lands on the prompt that caused it. A prompt whose embeddings do not fill
exactly its image placeholders (the encoder disagrees with the image processor) fails too, by name.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection

from stages.engine.multimodal import ImageEmbedding, ImageInput
from stages.engine.prefix_cache import image_spans
from stages.engine.request import Request

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


def encode_missing(encode: Encoder, media_token_ids: Collection[int], requests: list[Request], errors: dict[str, str]) -> None:
    """Give the requests that came with pixels the embeddings their prefill needs; record in ``errors``
    (request id -> why) those that fail. Images whose placeholders lie wholly in the request's cached
    prefix are not encoded (their KV is there): they get ``ImageEmbedding.skipped`` stand-ins."""
    pending: list[tuple[Request, list[int]]] = []  # each request with the indexes of its images to encode
    for request in requests:
        if request.prompt.images:
            wanted = _images_to_encode(request, media_token_ids)
            failed = load_deferred(request.prompt.images, wanted)
            if failed is not None:
                errors[request.request_id] = failed
            elif wanted or request.prompt.embeddings is None:  # none wanted: stand-ins only
                pending.append((request, wanted))
    encoded = encode_prompts(encode, [[r.prompt.images[i] for i in wanted] for r, wanted in pending])
    for (request, wanted), result in zip(pending, encoded):
        if isinstance(result, str):
            errors[request.request_id] = result
            continue
        embeddings, had = dict(zip(wanted, result)), request.prompt.embeddings
        request.prompt.embeddings = [embeddings[i] if i in embeddings else had[i] if had is not None
                                     else ImageEmbedding.skipped(image)
                                     for i, image in enumerate(request.prompt.images)]


def load_deferred(images: list[ImageInput], wanted: list[int]) -> str | None:
    """Make the pixels of the deferred images among ``wanted`` (indexes into ``images``), replacing
    them in ``images`` (so a later recompute finds them made). Runs on the engine thread: only for an
    image a stale prefix hint left unmade, which is rare. Returns why one failed (the others of the
    list are then left as they are), or None."""
    for i in wanted:
        if not images[i].is_deferred:
            continue
        try:
            images[i] = images[i].loaded()
        except Exception as exc:
            log.warning("image %d, deferred while its prefix was cached, could not be made: %s: %s",
                        i, type(exc).__name__, exc)
            return f"image {i} could not be decoded and preprocessed: {type(exc).__name__}: {exc}"
        log.info("image %d made late: the cached prefix that covered it was gone at admission", i)
    return None


def _images_to_encode(request: Request, media_token_ids: Collection[int]) -> list[int]:
    """Indexes of the request's images with a placeholder at or past ``num_computed`` and no
    embedding yet (none, or a stand-in)."""
    had = request.prompt.embeddings
    if not request.num_computed:
        wanted = list(range(len(request.prompt.images)))
    else:
        spans = image_spans(request.prompt.token_ids, media_token_ids, request.prompt.image_tokens)
        wanted = [i for i, (_, end) in enumerate(spans) if end > request.num_computed]
    return [i for i in wanted if had is None or had[i].stand_in]
