"""The workload: a ~1k-token system prompt led by a number no other request carries, then N distinct
PNGs and a question; a round's plan of requests, the same for every system."""

from __future__ import annotations

import base64
from dataclasses import dataclass
from pathlib import Path

from bench.common.sized_text import chat_tokens, sized_words
from bench.epd_cache.workload import unique_png

QUESTION = "Describe these pictures in one line."
TAG_DIGITS = 6


@dataclass(frozen=True)
class Request:
    """One request of a round: ``n`` images, ``index`` per n (-1: the warm-up), its ``number``."""

    n: int
    index: int
    round: int

    @property
    def number(self) -> int:
        """Distinct per request of a run: leads its system prompt and salts its images."""
        return 10_000 * self.round + 100 * (self.index + 1) + self.n

    @property
    def warmup(self) -> bool:
        return self.index < 0


def plan_round(counts: list[int], requests: int, round_index: int) -> list[Request]:
    """A round: the warm-up of each N, then ``requests`` per N, Ns interleaved."""
    plan = [Request(n, -1, round_index) for n in counts]
    for i in range(requests):
        plan += [Request(n, i, round_index) for n in counts]
    return plan


def system_text(model_dir: Path, target_tokens: int) -> tuple[str, int]:
    """Common words sized so that the system message (a request's number, then this) and the
    question come to ``target_tokens`` prompt tokens with the chat template, images aside; returns the
    text and that measured length."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return sized_words(lambda text: chat_tokens(tokenizer, [{"role": "system", "content": f"{0:0{TAG_DIGITS}d} {text}"},
                                                            {"role": "user", "content": QUESTION}]),
                       "You answer questions about images. Background: ", target_tokens, seed=1)


@dataclass(frozen=True)
class Bodies:
    """The chat bodies of a run: ``system`` the system prompt's text, ``size`` the images' pixels."""

    system: str
    size: int
    max_tokens: int

    def pngs(self, request: Request) -> list[bytes]:
        """The request's N distinct PNGs (never sent by another request of the run)."""
        return [unique_png(request.n * 8 + slot, self.size, request.number) for slot in range(request.n)]

    def body(self, request: Request) -> dict:
        images = [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(p).decode()}}
                  for p in self.pngs(request)]
        messages = [{"role": "system", "content": f"{request.number:0{TAG_DIGITS}d} {self.system}"},
                    {"role": "user", "content": [*images, {"type": "text", "text": QUESTION}]}]
        return {"messages": messages, "max_tokens": self.max_tokens, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
