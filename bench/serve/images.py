"""Generated test images: PNGs as ``data:`` URLs, distinct per ``seed`` and the same bytes every time for
the same (width, height, seed). Shapes on a gradient, so they compress like a simple picture (a few
KiB to tens of KiB), not like noise."""

from __future__ import annotations

import base64
import io
import random


def png_data_url(width: int, height: int, seed: int) -> str:
    """A ``width`` x ``height`` RGB PNG (a gradient and five seeded shapes) as a ``data:image/png`` URL."""
    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    image = Image.linear_gradient("L").resize((width, height)).convert("RGB")
    draw = ImageDraw.Draw(image)
    for _ in range(5):
        x0, y0 = rng.randrange(width), rng.randrange(height)
        x1, y1 = x0 + rng.randrange(1, max(2, width // 2)), y0 + rng.randrange(1, max(2, height // 2))
        color = (rng.randrange(256), rng.randrange(256), rng.randrange(256))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)((x0, y0, x1, y1), fill=color)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
