"""EPD mode: a request's images as cache references. Pure: no I/O.

The router turns each ``image_url`` part (a ``data:`` URL by now: remote URLs were fetched by
``router.image_fetch``) into a ``RefImage``: the file's bytes decoded from base64, its cache key
``cache.keys.image_key(bytes, vision_fingerprint)`` and its width and height read from the file's
header (PIL, no pixel is decoded). The prefill and the decode get the chat body with every such
part replaced by ``{"type": "image_ref", "image_ref": {"key", "width", "height"}}`` (``with_refs``);
an encoder gets the ``data:`` URLs of the images it must encode (``encode_body``).

Every refusal is an OpenAI-style 400 or 413 naming the part (``messages[i].content[j].image_url``),
raised before anything is planned.
"""

from __future__ import annotations

import base64
import binascii
import io
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import msgspec
from PIL import Image, UnidentifiedImageError

from cache.keys import image_key
from router.errors import RouterError, bad_request
from router.images import ImagePart

_encode = msgspec.json.Encoder().encode


@dataclass(frozen=True)
class RefImage:
    part: dict  # the client's content part (not modified)
    url: str  # its data: URL, as the encoder takes it
    key: str
    width: int
    height: int
    param: str  # the client's path of the part, messages[i].content[j].image_url (``router.client_params``)

    def ref(self) -> dict:
        return {"type": "image_ref", "image_ref": {"key": self.key, "width": self.width, "height": self.height}}


def ref_images(parts: Sequence[ImagePart], fingerprint: str, max_bytes: int) -> list[RefImage]:
    """Each part as a ``RefImage``, in order. 400 ``invalid_image_url`` / ``invalid_base64`` /
    ``invalid_image``, 413 ``image_too_large`` (over ``max_bytes``, or a canvas PIL refuses)."""
    return [_ref_image(part, fingerprint, max_bytes) for part in parts]


def _ref_image(part: ImagePart, fingerprint: str, max_bytes: int) -> RefImage:
    data = decode_data_url(part.url, part.param, max_bytes)
    width, height = header_size(data, part.param)
    return RefImage(part.part, part.url, image_key(data, fingerprint), width, height, part.param)


def decode_data_url(url: str, param: str, max_bytes: int) -> bytes:
    """``data:image/...;base64,...`` -> the file's bytes, bounded before decoding."""
    header, sep, payload = url[5:].partition(",") if url[:5].lower() == "data:" else ("", "", "")
    if not sep or not header.endswith(";base64"):
        raise bad_request("Image data URLs must be base64 encoded (data:image/...;base64,...).", param,
                          "invalid_image_url")
    if len(payload) // 4 * 3 > max_bytes + 3:
        raise _too_large(len(payload) // 4 * 3, max_bytes, param)
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise bad_request("The image data URL is not valid base64.", param, "invalid_base64") from None
    if len(data) > max_bytes:
        raise _too_large(len(data), max_bytes, param)
    return data


def header_size(data: bytes, param: str) -> tuple[int, int]:
    """(width, height) from the image file's header alone."""
    try:
        with Image.open(io.BytesIO(data)) as image:
            width, height = image.size
    except Image.DecompressionBombError:
        raise RouterError(413, "The image is too large to decode safely.", code="image_too_large",
                          param=param) from None
    except UnidentifiedImageError:
        raise bad_request("The image data is not an image in a supported format.", param, "invalid_image") from None
    except (OSError, SyntaxError, ValueError) as exc:
        raise bad_request(f"The image could not be read: {exc}", param, "invalid_image") from None
    if width <= 0 or height <= 0:
        raise bad_request("The image is empty.", param, "invalid_image")
    return width, height


def with_refs(body: dict, images: Sequence[RefImage]) -> dict:
    """A copy of ``body`` whose image parts are replaced by their references (``body`` is unchanged;
    only the messages and contents that hold an image are copied)."""
    if not images:
        return body
    refs = {id(image.part): image.ref() for image in images}
    messages = []
    for message in body["messages"]:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list) and any(id(part) in refs for part in content):
            message = {**message, "content": [refs.get(id(part), part) for part in content]}
        messages.append(message)
    return {**body, "messages": messages}


def encode_body(room: int, images: Iterable[RefImage]) -> bytes:
    """An encoder's ``POST /v1/encode`` body (``docs/protocol.md``): each image once, with its key."""
    unique = {image.key: image for image in images}
    return _encode({"room": room, "images": [{"key": key, "url": image.url} for key, image in unique.items()]})


def _too_large(size: int, max_bytes: int, param: str) -> RouterError:
    return RouterError(413, f"The image is {size} bytes; this router accepts at most {max_bytes} bytes per image "
                       "(--max-image-bytes).", param=param, code="image_too_large")
