"""The generated test image of the benchmark scripts, and PNG ``data:`` URLs. PIL is imported late."""

from __future__ import annotations

import base64
import io


def make_image(index: int, size: int = 64):  # -> PIL.Image.Image
    """A small PNG: a gradient with a coloured square whose place and colour depend on ``index``."""
    from PIL import Image, ImageDraw

    image = Image.linear_gradient("L").resize((size, size)).convert("RGB")
    draw = ImageDraw.Draw(image)
    x = (index * 13) % (size // 2)
    y = (index * 7) % (size // 2)
    draw.rectangle((x, y, x + size // 3, y + size // 3), fill=((60 * index) % 256, 120, (255 - 40 * index) % 256))
    return image


def image_url(image) -> str:
    """A PIL image as a PNG ``data:`` URL."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
