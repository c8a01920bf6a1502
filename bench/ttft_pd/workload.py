"""The workloads: a short text, one 64x64 image, ~2000 tokens of text (sized with the checkpoint's
tokenizer); each one user turn, streamed, ``ignore_eos``. Each says whether its timed requests hit the
prefix cache (``CACHE``). Every request has a system turn that starts with a number (``tag``: fixed
width, one token a digit, so the prompt length is the same for every request) before the template's
usual "You are a helpful assistant."; the number's digits are tokens 3-8 of the prompt, inside the
first 16-token KV block, so requests with different numbers share no block. A miss workload gives
every request of a phase its own number; a hit workload repeats one prompt (``HIT_NUMBER``), which its
warm-up puts into the cache. (The number at the start of the user text would not do: the template's
system turn ahead of it is 15 tokens, so the first block would hold only its leading digit.)"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from bench.common.sized_text import chat_tokens, sized_words
from bench.common.images import image_url, make_image

WORKLOADS = ("text_short", "image_64", "text_2k", "text_2k_hit")
CACHE = {"text_short": "miss", "image_64": "miss", "text_2k": "miss", "text_2k_hit": "hit"}
LONG_TOKENS = 2000  # target prompt length of text_2k and text_2k_hit
TAG_DIGITS = 6
HIT_NUMBER = 10**TAG_DIGITS - 1  # the one number of a hit workload; request_number never gives it
SHORT = "Hello there! What is the capital of the country with the tallest mountain?"


def tag(number: int) -> str:
    """``number`` as ``TAG_DIGITS`` digits (each its own token with this tokenizer)."""
    if not 0 <= number < 10**TAG_DIGITS:
        raise ValueError(f"request number {number} does not fit {TAG_DIGITS} digits")
    return f"{number:0{TAG_DIGITS}d}"


def system(number: int) -> dict:
    """The system turn of request ``number``: its ``tag``, then the template's usual words."""
    return {"role": "system", "content": f"{tag(number)} You are a helpful assistant."}


def request_number(workload: str, round_index: int, index: int) -> int:
    """The number that starts request ``index`` (-1: the warm-up) of round ``round_index`` (from 1):
    for a miss workload distinct per request of a phase, across workloads too (the system turn fills
    the first KV block, so two workloads' requests with one number would share it), and the same
    in every phase (so each system gets the same prompts and the replies can be compared):
    round, workload, index as digits ``R W IIII``; ``HIT_NUMBER`` for a hit workload."""
    if CACHE[workload] == "hit":
        return HIT_NUMBER
    if not (1 <= round_index <= 9 and -1 <= index < 9998):
        raise ValueError(f"request numbers take rounds 1-9 and up to 9998 requests, got round {round_index}, "
                         f"request {index}")
    return 10**5 * round_index + 10**4 * WORKLOADS.index(workload) + index + 1


def long_text(model_dir: Path, target_tokens: int, lead: dict | None = None) -> tuple[str, int]:
    """Common words (the tokenizer's own training vocabulary) sized so that a request (the turn
    ``lead`` if given, e.g. ``system(0)``, then this as the user's text) is ``target_tokens`` prompt
    tokens with the chat template; returns the text and that measured prompt length."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    leading = [lead] if lead is not None else []
    return sized_words(lambda text: chat_tokens(tokenizer, [*leading, {"role": "user", "content": text}]),
                       "Summarize this: ", target_tokens, seed=0)


@dataclass(frozen=True)
class Bodies:
    """The chat bodies of a run's ``workloads``: ``long`` is the text of text_2k and text_2k_hit."""

    workloads: tuple[str, ...]
    long: str
    max_tokens: int

    def body(self, workload: str, number: int) -> dict:
        """The streamed chat body of ``workload`` whose system turn starts with ``tag(number)``."""
        content: list[dict]
        if workload == "text_short":
            content = [{"type": "text", "text": SHORT}]
        elif workload == "image_64":
            content = [{"type": "image_url", "image_url": {"url": image_url(make_image(3))}},
                       {"type": "text", "text": "What is in this picture?"}]
        elif workload in ("text_2k", "text_2k_hit"):
            content = [{"type": "text", "text": self.long}]
        else:
            raise ValueError(f"unknown workload {workload!r}; choose from {WORKLOADS}")
        return {"messages": [system(number), {"role": "user", "content": content}], "max_tokens": self.max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
