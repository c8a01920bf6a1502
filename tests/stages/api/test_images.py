"""Images in a chat request (stages/api/images.py): data URLs decoded (PNG, JPEG), remote and
malformed URLs refused, bytes and pixels bounded before decoding, the limits validated. No model."""

from __future__ import annotations

import io
import random

import pytest
from PIL import Image

from stages.api.images import ImageLimits, decode_data_url, load_image, open_image
from tests.support.stage_api import LIMITS, data_url, png, png_header_only, raises_api_error

pytestmark = pytest.mark.unit


def test_data_url_roundtrip_png_and_jpeg():
    image = load_image(data_url(png(20, 10)), LIMITS)
    assert image.size == (20, 10) and image.getpixel((0, 0)) == (200, 10, 10)
    buffer = io.BytesIO()
    Image.new("RGB", (16, 16), (0, 0, 255)).save(buffer, format="JPEG")
    assert load_image(data_url(buffer.getvalue(), "image/jpeg"), LIMITS).size == (16, 16)


def test_remote_urls_are_refused_with_a_pointer_to_the_router():
    for url in ("http://example.com/cat.png", "https://example.com/cat.png"):
        error = raises_api_error(decode_data_url, url, LIMITS, "p")
        assert (error.status, error.code, error.param) == (400, "remote_image_url", "p")
        assert "not fetched by stage servers" in error.message and "router" in error.message


@pytest.mark.parametrize("url, code", [
    ("ftp://example.com/cat.png", "invalid_image_url"),
    ("cat.png", "invalid_image_url"),
    ("data:image/png,rawbytes", "invalid_image_url"),
    ("data:image/png;base64,@@not*base64@@", "invalid_base64"),
    ("data:image/png;base64,abc", "invalid_base64"),  # bad padding
])
def test_malformed_image_urls_are_400(url, code):
    error = raises_api_error(decode_data_url, url, LIMITS)
    assert (error.status, error.code) == (400, code)


def test_bytes_that_are_not_an_image_are_400():
    error = raises_api_error(load_image, data_url(b"this is not an image at all"), LIMITS)
    assert (error.status, error.code) == (400, "invalid_image")
    truncated = png(40, 40)[:60]
    assert raises_api_error(load_image, data_url(truncated), LIMITS).status == 400


def test_too_many_bytes_is_413_before_and_after_decoding():
    noise = Image.frombytes("RGB", (60, 60), random.Random(0).randbytes(60 * 60 * 3))
    buffer = io.BytesIO()
    noise.save(buffer, format="PNG")
    assert len(buffer.getvalue()) > LIMITS.max_bytes
    error = raises_api_error(load_image, data_url(buffer.getvalue()), LIMITS)
    assert (error.status, error.code) == (413, "image_too_large") and str(LIMITS.max_bytes) in error.message
    exact = ImageLimits(max_bytes=len(png()) - 1)  # passes the cheap length bound, fails the exact check
    assert raises_api_error(decode_data_url, data_url(png()), exact).status == 413


def test_pixel_limit_is_checked_from_the_header_before_decoding():
    # No pixel data follows the header: a 413 (not a 400 "could not decode") proves nothing was decoded.
    error = raises_api_error(open_image, png_header_only(200, 100), LIMITS)
    assert (error.status, error.code) == (413, "image_too_large") and "200x100" in error.message
    assert open_image(png(100, 100), LIMITS).size == (100, 100)  # exactly at the limit is fine


def test_decompression_bomb_header_is_413():
    error = raises_api_error(open_image, png_header_only(100_000, 100_000), ImageLimits(max_pixels=10**12))
    assert (error.status, error.code) == (413, "image_too_large")


def test_limits_validate_and_name_the_flag():
    with pytest.raises(ValueError, match="--max-image-pixels"):
        ImageLimits(max_pixels=0)
