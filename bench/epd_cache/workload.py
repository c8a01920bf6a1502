"""The workload: distinct generated PNGs (never the same one twice in a run), the chat bodies, and a
round's miss/hit pairs. Pure but the PNG encoding."""

from __future__ import annotations

import base64
import io
from dataclasses import dataclass

from bench.common.images import make_image

QUESTION = "Describe these pictures."


def unique_png(index: int, size: int, salt: int) -> bytes:
    """A distinct PNG per (``index``, ``salt``): ``common.make_image`` with both numbers written as
    black/white pixels along the top row (the square alone repeats every 64 indices)."""
    image = make_image(index % 64, size)
    pixels = image.load()
    for bit in range(min(size, 64)):
        word = index if bit < 32 else salt
        on = (word >> (bit % 32)) & 1
        pixels[bit, 0] = (255, 255, 255) if on else (0, 0, 0)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def chat_body(pngs: list[bytes], max_tokens: int, stream: bool = True) -> dict:
    content = [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(p).decode()}}
               for p in pngs]
    content.append({"type": "text", "text": QUESTION})
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


@dataclass(frozen=True)
class Pair:
    """One miss/hit pair of the TTFT workload: N images never sent before, then the same again."""

    n: int
    index: int  # per N: 0..requests-1 timed; -1 the warm-up
    round: int
    pngs: tuple[bytes, ...]


class ImageSource:
    """Hands out distinct PNGs, never the same one twice in a run."""

    def __init__(self, size: int, salt: int) -> None:
        self.size, self.salt, self.next_index = size, salt, 0

    def take(self, count: int) -> list[bytes]:
        out = [unique_png(self.next_index + i, self.size, self.salt) for i in range(count)]
        self.next_index += count
        return out


def plan_round(source: ImageSource, counts: list[int], requests: int, round_index: int) -> list[Pair]:
    """A round's pairs: the warm-up pair of each N, then ``requests`` pairs per N, Ns interleaved."""
    pairs = [Pair(n, -1, round_index, tuple(source.take(n))) for n in counts]
    for i in range(requests):
        pairs += [Pair(n, i, round_index, tuple(source.take(n))) for n in counts]
    return pairs
