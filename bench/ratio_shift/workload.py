"""The load of each phase: image-heavy chats (3-4 images no other request has) and text-only chats
(a long prompt whose first words no other request shares). Pure but for PIL (imported late)."""

from __future__ import annotations

import random
from dataclasses import dataclass

from bench.common.images import image_url, make_image

IMAGES = "images"
TEXT = "text"
KINDS = (IMAGES, TEXT)
WORDS = ("river stone window garden silver morning lantern harbor meadow copper violet thunder "
         "pencil orchard canyon marble feather compass velvet glacier ember willow beacon tundra "
         "saffron quarry prism falcon linen cobalt juniper atlas").split()


@dataclass(frozen=True)
class Phase:
    """One phase of the run: its ``kind`` of load for ``duration_s`` seconds from ``start_s`` (seconds
    from the run's start)."""

    name: str
    kind: str
    start_s: float
    duration_s: float

    @property
    def end_s(self) -> float:
        return self.start_s + self.duration_s


def plan_phases(kinds: list[str], duration_s: float) -> list[Phase]:
    """Back-to-back phases of ``duration_s`` each, named ``<index>-<kind>`` (``1-images``, ``2-text``...)."""
    return [Phase(f"{i + 1}-{kind}", kind, i * duration_s, duration_s) for i, kind in enumerate(kinds)]


def phase_at(phases: list[Phase], t_s: float) -> Phase | None:
    """The phase running at ``t_s`` (seconds from the run's start); None before the first or after the last."""
    return next((p for p in phases if p.start_s <= t_s < p.end_s), None)


def image_count(serial: int) -> int:
    """3 or 4 images, alternating."""
    return 3 + serial % 2


def unique_image(serial: int, k: int, size: int):  # -> PIL.Image.Image
    """Image ``k`` of request ``serial``: the shared test image with the pair's number written into
    its first row's pixels, so no two images of a run (or of runs with different ``serial`` ranges)
    have the same pixels."""
    image = make_image(serial * 7 + k, size)
    code = serial * 8 + k
    for x in range(8):
        image.putpixel((x, 0), ((code >> (8 * (x % 4))) & 255, x * 31 % 256, (code >> 32) & 255))
    return image


def text_prompt(serial: int, words: int) -> str:
    """A prompt of ``words`` words that starts with the request's own number and draws its words from
    a generator seeded by it: the prefix cache matches no block of another request."""
    rng = random.Random(serial)
    return f"Request {serial}: " + " ".join(rng.choice(WORDS) for _ in range(words)) + ". Summarize."


def chat_body(kind: str, serial: int, args) -> dict:
    """The streamed chat body of request ``serial`` of ``kind``; ``args`` gives ``image_size``,
    ``prompt_words`` and ``max_tokens``."""
    if kind == IMAGES:
        parts: list[dict] = [{"type": "text", "text": f"Request {serial}: what differs between these pictures?"}]
        parts += [{"type": "image_url", "image_url": {"url": image_url(unique_image(serial, k, args.image_size))}}
                  for k in range(image_count(serial))]
        content: str | list[dict] = parts
    else:
        content = text_prompt(serial, args.prompt_words)
    return {"messages": [{"role": "user", "content": content}], "max_tokens": args.max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
