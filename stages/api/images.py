"""Turning an ``image_url`` into a PIL image, within limits.

Stage servers take ``data:`` URLs only; remote URLs are fetched by the router (from its allow-list),
never by a stage. Size limits are enforced before the expensive step each protects: the encoded
length before base64 decoding, the byte count before parsing, and width x height from the header
before the pixels are decoded (so a small file that claims a huge canvas costs nothing).
"""

from __future__ import annotations

import base64
import binascii
import io

from PIL import Image, UnidentifiedImageError

from stages.api.errors import APIError, bad_request, too_large
from stages.config import ImageLimits


def decode_data_url(url: str, limits: ImageLimits, param: str | None = None) -> bytes:
    """``data:image/png;base64,...`` -> the image's bytes. Raises APIError (400 or 413)."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme in ("http", "https"):
        raise bad_request("Remote image URLs are not fetched by stage servers; send the image as a data: URL "
                          "(base64), or send the request through the router, which fetches allowed URLs.",
                          param, "remote_image_url")
    if scheme != "data":
        raise bad_request("image_url must be a data: URL (data:image/...;base64,...).", param, "invalid_image_url")
    header, sep, payload = url[5:].partition(",")
    if not sep or not header.endswith(";base64"):
        raise bad_request("Image data URLs must be base64 encoded (data:image/...;base64,...).", param,
                          "invalid_image_url")
    if len(payload) // 4 * 3 > limits.max_bytes + 3:  # cheap bound before decoding
        raise _over_bytes(len(payload) // 4 * 3, limits, param)
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise bad_request("The image data URL is not valid base64.", param, "invalid_base64") from None
    if len(data) > limits.max_bytes:
        raise _over_bytes(len(data), limits, param)
    return data


def open_image(data: bytes, limits: ImageLimits, param: str | None = None) -> Image.Image:
    """Bytes -> a fully decoded PIL image, checking the pixel count from the header first."""
    try:
        image = Image.open(io.BytesIO(data))  # reads the header only
        width, height = image.size
        if width * height > limits.max_pixels:
            raise _over_pixels(width, height, limits, param)
        image.load()
    except APIError:
        raise
    except Image.DecompressionBombError:  # PIL's own guard, raised by open() for absurd canvases
        raise too_large(f"The image is too large to decode safely (limit {limits.max_pixels} pixels).", param,
                        "image_too_large") from None
    except UnidentifiedImageError:
        raise bad_request("The image data is not an image in a supported format.", param, "invalid_image") from None
    except (OSError, SyntaxError, ValueError) as exc:
        raise bad_request(f"The image could not be decoded: {exc}", param, "invalid_image") from None
    if width <= 0 or height <= 0:
        raise bad_request("The image is empty.", param, "invalid_image")
    return image


def load_image(url: str, limits: ImageLimits, param: str | None = None) -> Image.Image:
    return open_image(decode_data_url(url, limits, param), limits, param)


def image_size(url: str, limits: ImageLimits, param: str | None = None) -> tuple[int, int]:
    """(width, height) of a ``data:`` URL's image from its header alone: no pixel is decoded (a
    decode server needs only the size). Same limits and errors as ``load_image``, except that a
    file whose pixel data is broken past its header is not noticed here."""
    data = decode_data_url(url, limits, param)
    try:
        with Image.open(io.BytesIO(data)) as image:  # reads the header only
            width, height = image.size
    except Image.DecompressionBombError:
        raise too_large(f"The image is too large to decode safely (limit {limits.max_pixels} pixels).", param,
                        "image_too_large") from None
    except UnidentifiedImageError:
        raise bad_request("The image data is not an image in a supported format.", param, "invalid_image") from None
    except (OSError, SyntaxError, ValueError) as exc:
        raise bad_request(f"The image could not be decoded: {exc}", param, "invalid_image") from None
    check_size(width, height, limits, param)
    return width, height


def check_size(width: int, height: int, limits: ImageLimits, param: str | None = None) -> None:
    """An image's size within ``--max-image-pixels`` and not empty; APIError 413 or 400."""
    if width * height > limits.max_pixels:
        raise _over_pixels(width, height, limits, param)
    if width <= 0 or height <= 0:
        raise bad_request("The image is empty.", param, "invalid_image")


def _over_bytes(size: int, limits: ImageLimits, param: str | None) -> APIError:
    return too_large(f"The image is {size} bytes; this server accepts at most {limits.max_bytes} bytes per image.",
                     param, "image_too_large")


def _over_pixels(width: int, height: int, limits: ImageLimits, param: str | None) -> APIError:
    return too_large(f"The image is {width}x{height} = {width * height} pixels; this server accepts at most "
                     f"{limits.max_pixels} pixels per image.", param, "image_too_large")
