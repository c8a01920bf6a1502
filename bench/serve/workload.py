"""The requests of a run: the seeded synthetic multimodal mix, or a recorded JSONL file.

JSONL format (``--workload FILE``, written by ``--save-workload FILE``): one JSON object per line, an
OpenAI chat request body without the fields the benchmark sets itself::

    {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}},
        {"type": "text", "text": "Describe the picture."}]}],
     "max_tokens": 64}

``messages`` is required; ``max_tokens`` is optional (absent: the server's default); any other field
(``top_p``, ``seed``, ...) is sent as it is. ``model``, ``stream``, ``stream_options`` and the
benchmark's ``temperature`` / ``ignore_eos`` are set by the run (the file's own values are replaced).
Image URLs may be ``data:`` URLs (self-contained files) or http(s) URLs the server can fetch.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

from bench.serve.config import Mix
from bench.serve.images import png_data_url

RUN_FIELDS = ("model", "stream", "stream_options")  # set by the run, replaced if a file has them
WORDS = ("the", "a", "picture", "shows", "what", "is", "in", "this", "image", "describe", "color", "shape",
         "left", "right", "top", "bottom", "red", "blue", "green", "circle", "square", "large", "small", "near",
         "far", "light", "dark", "and", "or", "with", "of", "how", "many", "objects", "are", "there", "please",
         "answer", "briefly", "explain", "scene", "detail", "one", "two", "three", "sky", "tree", "house")


@dataclass(frozen=True)
class Request:
    """One request of a workload: the chat ``messages``, ``max_tokens`` (None: the server's default)
    and any other body fields (``extra``) to send as they are."""

    messages: list
    max_tokens: int | None
    extra: dict = field(default_factory=dict)

    def body(self) -> dict:
        """The recorded form (one JSONL line): messages, max_tokens when set, the extra fields."""
        out: dict = {"messages": self.messages}
        if self.max_tokens is not None:
            out["max_tokens"] = self.max_tokens
        return {**out, **self.extra}


# --- the synthetic mix -------------------------------------------------------------------------
def synthesize(mix: Mix) -> list[Request]:
    """``mix.num_requests`` requests, the same for the same ``mix`` (seeded). Each draws its image count,
    then per image slot either an image already sent (``repeat_image_share``) or a new generated PNG of
    a drawn size; then its prompt words and ``max_tokens``."""
    rng = random.Random(mix.seed)
    sent: list[str] = []  # distinct images generated so far
    requests = []
    for index in range(mix.num_requests):
        urls = []
        for _ in range(_weighted(rng, mix.images_per_request)):
            if sent and rng.random() < mix.repeat_image_share:
                urls.append(rng.choice(sent))
            else:
                width, height = _weighted(rng, mix.image_sizes)
                sent.append(png_data_url(width, height, seed=mix.seed * 1_000_003 + len(sent)))
                urls.append(sent[-1])
        words = _around(rng, mix.input_len, mix.range_ratio)
        text = f"Request {index}: " + " ".join(rng.choice(WORDS) for _ in range(words))
        requests.append(Request(_user_turn(urls, text), _around(rng, mix.output_len, mix.range_ratio)))
    return requests


def _weighted(rng: random.Random, pairs: tuple):
    values, weights = zip(*pairs)
    return rng.choices(values, weights=weights)[0]


def _around(rng: random.Random, length: int, ratio: float) -> int:
    return rng.randint(max(1, int(length * (1 - ratio))), max(1, int(length * (1 + ratio))))


def _user_turn(urls: list[str], text: str) -> list[dict]:
    if not urls:
        return [{"role": "user", "content": text}]
    parts = [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


# --- JSONL -------------------------------------------------------------------------------------
def write_jsonl(path: Path, requests: list[Request]) -> None:
    """One line per request (``Request.body``)."""
    with open(path, "w") as out:
        for request in requests:
            out.write(json.dumps(request.body(), separators=(",", ":")) + "\n")


def read_jsonl(path: Path) -> list[Request]:
    """The requests of a JSONL workload; ValueError names the file and line of the first bad one."""
    requests = []
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise ValueError(f"--workload: cannot read {path}: {exc.strerror or exc}") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            requests.append(parse_line(json.loads(line)))
        except (json.JSONDecodeError, ValueError) as exc:
            raise ValueError(f"--workload {path} line {number}: {exc}") from None
    if not requests:
        raise ValueError(f"--workload {path}: no requests in the file")
    return requests


def parse_line(obj: object) -> Request:
    """One JSONL line's object -> Request (fields the run sets are dropped)."""
    if not isinstance(obj, dict):
        raise ValueError("expected a JSON object")
    messages = obj.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ValueError("'messages' must be a non-empty list")
    max_tokens = obj.get("max_tokens")
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1):
        raise ValueError(f"'max_tokens' must be an integer >= 1, got {max_tokens!r}")
    extra = {k: v for k, v in obj.items() if k not in ("messages", "max_tokens", *RUN_FIELDS)}
    return Request(messages, max_tokens, extra)


# --- summary -----------------------------------------------------------------------------------
def image_urls(request: Request) -> list[str]:
    """The image URLs of a request's messages, in order."""
    return [part["image_url"]["url"] for message in request.messages if isinstance(message.get("content"), list)
            for part in message["content"] if isinstance(part, dict) and part.get("type") == "image_url"]


def prompt_text(request: Request) -> str:
    """The text of a request's messages (string contents and text parts), joined by newlines."""
    texts = []
    for message in request.messages:
        content = message.get("content")
        if isinstance(content, str):
            texts.append(content)
        elif isinstance(content, list):
            texts += [part.get("text", "") for part in content if isinstance(part, dict) and part.get("type") == "text"]
    return "\n".join(texts)


def summarize(requests: list[Request]) -> dict:
    """What the workload is: counts of requests and images, the share of image slots that repeat an
    image sent before (same URL), mean images, image bytes, prompt words and max_tokens."""
    seen: set[str] = set()
    images = repeats = image_bytes = 0
    for request in requests:
        for url in image_urls(request):
            images += 1
            repeats += url in seen
            seen.add(url)
            if url.startswith("data:"):
                image_bytes += len(url.partition(",")[2]) * 3 // 4
    n = len(requests)
    max_tokens = [r.max_tokens for r in requests if r.max_tokens is not None]
    return {
        "requests": n,
        "text_only_requests": sum(1 for r in requests if not image_urls(r)),
        "images": images,
        "distinct_images": len(seen),
        "repeated_image_share": round(repeats / images, 3) if images else 0.0,
        "mean_images_per_request": round(images / n, 3),
        "mean_image_kib": round(image_bytes / images / 1024, 1) if images else 0.0,
        "mean_prompt_words": round(sum(len(prompt_text(r).split()) for r in requests) / n, 1),
        "mean_max_tokens": round(sum(max_tokens) / len(max_tokens), 1) if max_tokens else None,
    }
