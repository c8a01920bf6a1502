"""A stage's refusal, naming what the client sent (epd mode). Pure.

In epd mode no stage sees the client's body. The prefill and the decode get each image part as an
``image_ref`` (a video part as a ``video_ref``) at the same place (``router.plan.image_refs.with_refs``); an encoder gets
``{"room", "images": [{"key", "url"}]}``, each image it must encode once, in its own order. A stage's
4xx names its own fields (``messages[0].content[1].image_ref``, ``images[0]``), which the client
never sent; the router forwards it with ``param`` the client's path of that part
(``messages[0].content[1].image_url``) and the rest of the body as the stage wrote it.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

import msgspec

from router.plan.image_refs import Referenced
from router.plan.modes import Target
from router.dispatch.verdict import Failure

_ENCODED = re.compile(r"images\[(\d+)\]")


def client_param(param: str | None, stage: str, images: Sequence[Referenced], encoded: Sequence[str]) -> str | None:
    """``param`` of a ``stage``'s error as the client's path. ``images``: the request's image parts
    (their ``param`` is the client's ``messages[i].content[j].image_url``); ``encoded``: the keys of the
    encoder's body, in its order (encoder errors only). A path about nothing the client sent (an
    encoder's ``room``) is None; one the router did not rewrite is returned as it is."""
    if param is None or not images:
        return param
    if stage == "encoder":
        if param == "images":
            return "messages"
        match = _ENCODED.match(param)
        index = int(match[1]) if match else len(encoded)
        key = encoded[index] if index < len(encoded) else None
        return next((image.param for image in images if image.key == key), None)
    for image in images:
        ref = image.param.removesuffix("_url") + "_ref"  # ...image_url -> ...image_ref (video_url -> video_ref)
        if param == ref or param.startswith(ref + "."):
            return image.param
    return param


def as_client_sees(failure: Failure, images: Sequence[Referenced], targets: Sequence[Target]) -> Failure:
    """``failure`` (a stage's 4xx, forwarded as its body) with the body's ``param`` as the client's path
    (``client_param``; ``targets``: the attempt's, whose encoder bodies give each encoder's order).
    Unchanged when the path is, or when there is no body to forward."""
    if failure.raw is None or not images:
        return failure
    try:
        body = msgspec.json.decode(failure.raw)
    except msgspec.DecodeError:
        return failure
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict) or not isinstance(error.get("param"), str):
        return failure
    encoder = next((t.body for t in targets if t.stage == "encoder" and t.worker.url == failure.url), None)
    param = client_param(error["param"], failure.stage, images, _keys(encoder) if encoder is not None else [])
    if param == error["param"]:
        return failure
    return dataclasses.replace(failure, raw=msgspec.json.encode({**body, "error": {**error, "param": param}}))


def _keys(encode_body: bytes) -> list[str]:
    """The keys of an encoder's ``/v1/encode`` body (``router.plan.image_refs.encode_body``), in its order."""
    images = msgspec.json.decode(encode_body).get("images")
    return [image.get("key") for image in images] if isinstance(images, list) else []
