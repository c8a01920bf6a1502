"""An image as a client sends it -> its checked bytes, its size from the file header, its pixels.

The one place that parses ``data:`` URLs, base64 and image headers: the router (``router.plan.image_refs``,
``router.plan.image_fetch``), the API layer of every stage (``stages.api.images``) and the encoder's
``/v1/encode`` use it (the codes of its refusals: ``contract.errors.Code``). It lives in ``cache`` because
the router may import ``cache`` and nothing of ``stages``, and the cache keys these very bytes
(``cache.keys.image_key``). Pure: no I/O, no torch, nothing else of ours (a leaf).

Each limit is checked before the expensive step it protects: the encoded length before base64
decoding, the byte count before parsing, width x height from the header before any pixel is decoded
(a small file that claims a huge canvas costs nothing; PIL's own decompression-bomb guard refuses
canvases over ``2 * Image.MAX_IMAGE_PIXELS`` while reading the header). A refusal is ``ImageRefused``
(an HTTP status, a code, a message); the caller names the part (``param``) and raises its own error.
"""

from __future__ import annotations

import base64
import binascii
import io
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from PIL import Image, UnidentifiedImageError

from contract.errors import Code


@dataclass(frozen=True)
class ImageBounds:
    """The limits on one image, and who holds them (named in the refusals: "this server", "this router")."""

    max_bytes: int  # --max-image-bytes: the file's size
    max_pixels: int | None = None  # --max-image-pixels: width * height; None: PIL's bomb guard only
    holder: str = "server"

    def __post_init__(self) -> None:
        if self.max_bytes <= 0 or (self.max_pixels is not None and self.max_pixels <= 0):
            raise ValueError(f"image limits must be > 0, got {self.max_bytes} bytes, {self.max_pixels} pixels")


class ImageRefused(Exception):
    """An image refused: ``code`` an image code of ``contract.errors.Code``, ``status`` its (400 or 413),
    ``message`` for the client."""

    def __init__(self, code: Code, message: str) -> None:
        super().__init__(message)
        self.status = code.status
        self.code = code
        self.message = message


def url_scheme(url: str) -> str:
    """``"data"``, ``"https"``, ... lower-cased; "" when the URL has no scheme."""
    return url.split(":", 1)[0].lower() if ":" in url else ""


def data_url_bytes(url: str, bounds: ImageBounds) -> bytes:
    """``data:image/...;base64,...`` -> the file's bytes (not yet known to be an image): 400
    ``remote_image_url`` for http(s), ``invalid_image_url``, ``invalid_base64``; 413 ``image_too_large``."""
    scheme = url_scheme(url)
    if scheme in ("http", "https"):
        raise ImageRefused(Code.REMOTE_IMAGE_URL, "Remote image URLs are not fetched by stage servers; send the "
                           "image as a data: URL (base64), or send the request through the router, which fetches "
                           "allowed URLs.")
    if scheme != "data":
        raise ImageRefused(Code.INVALID_IMAGE_URL, "image_url must be a data: URL (data:image/...;base64,...).")
    header, sep, payload = url[5:].partition(",")
    if not sep or not header.endswith(";base64"):
        raise ImageRefused(Code.INVALID_IMAGE_URL,
                           "Image data URLs must be base64 encoded (data:image/...;base64,...).")
    return _base64(payload, bounds, "The image data URL is not valid base64.")


def base64_bytes(payload: str, bounds: ImageBounds) -> bytes:
    """A file sent as plain base64 -> its bytes: 400 ``invalid_base64``, 413 ``image_too_large``."""
    return _base64(payload, bounds, "The image data is not valid base64.")


def header_size(data: bytes, bounds: ImageBounds) -> tuple[int, int]:
    """(width, height) from the file's header alone (no pixel is decoded), within ``bounds``: 400
    ``invalid_image``, 413 ``image_too_large``. Pixel data broken past the header is not noticed."""
    with _reading(), Image.open(io.BytesIO(data)) as image:
        width, height = image.size
    check_size(width, height, bounds)
    return width, height


def decoded_image(data: bytes, bounds: ImageBounds) -> Image.Image:
    """The file's pixels, decoded only after its header's size passed ``bounds``: 400 ``invalid_image``
    (also for a file broken past its header), 413 ``image_too_large``."""
    with _reading():
        image = Image.open(io.BytesIO(data))
        check_size(*image.size, bounds)
        image.load()
    return image


def check_size(width: int, height: int, bounds: ImageBounds) -> None:
    """413 ``image_too_large`` over ``bounds.max_pixels``; 400 ``invalid_image`` for an empty image."""
    if bounds.max_pixels is not None and width * height > bounds.max_pixels:
        raise ImageRefused(Code.IMAGE_TOO_LARGE, f"The image is {width}x{height} = {width * height} pixels; this "
                           f"{bounds.holder} accepts at most {bounds.max_pixels} pixels per image "
                           "(--max-image-pixels).")
    if width <= 0 or height <= 0:
        raise ImageRefused(Code.INVALID_IMAGE, "The image is empty.")


def too_many_bytes(size: int | str, bounds: ImageBounds) -> ImageRefused:
    """413 ``image_too_large`` for a file of ``size`` bytes (a number, or "more than N" mid-read)."""
    return ImageRefused(Code.IMAGE_TOO_LARGE, f"The image is {size} bytes; this {bounds.holder} accepts at most "
                        f"{bounds.max_bytes} bytes per image (--max-image-bytes).")


def _base64(payload: str, bounds: ImageBounds, invalid: str) -> bytes:
    try:
        return decode_payload(payload, bounds.max_bytes)
    except PayloadRefused as exc:
        raise ImageRefused(Code.INVALID_BASE64, invalid) if exc.size is None else too_many_bytes(exc.size, bounds) from None


class PayloadRefused(Exception):
    """A base64 payload refused: ``size`` its byte count past the bound, or None when it is not base64."""

    def __init__(self, size: int | None) -> None:
        super().__init__(size)
        self.size = size


def decode_payload(payload: str, max_bytes: int) -> bytes:
    """A file's base64 (of a ``data:`` URL or sent bare) -> its bytes, its size bounded from the encoded
    length before decoding and exactly after: ``PayloadRefused``. Shared with ``cache.video_bytes``, each
    giving the refusal its own code."""
    if len(payload) // 4 * 3 > max_bytes + 3:  # bounded before decoding
        raise PayloadRefused(len(payload) // 4 * 3)
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise PayloadRefused(None) from None
    if len(data) > max_bytes:
        raise PayloadRefused(len(data))
    return data


@contextmanager
def _reading() -> Iterator[None]:
    """PIL's failures while reading a file as ``ImageRefused`` (the pixel limit's own refusal passes)."""
    try:
        yield
    except Image.DecompressionBombError:  # raised by open() from the header, before any pixel
        raise ImageRefused(Code.IMAGE_TOO_LARGE, "The image is too large to decode safely: its header claims "
                           f"more than {2 * (Image.MAX_IMAGE_PIXELS or 0)} pixels.") from None
    except UnidentifiedImageError:
        raise ImageRefused(Code.INVALID_IMAGE, "The image data is not an image in a supported format.") from None
    except (OSError, SyntaxError, ValueError) as exc:
        raise ImageRefused(Code.INVALID_IMAGE, f"The image could not be decoded: {exc}") from None
