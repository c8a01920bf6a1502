"""The requests of bench/overload/ and bench/soak/: short text chats, greedy, a fixed number of
tokens (``ignore_eos``), every other one streamed, so a 200's body can be checked exactly."""

from __future__ import annotations


def body(index: int, max_tokens: int) -> dict:
    """Request ``index``'s chat body: a one-line question naming it, ``max_tokens`` tokens, streamed
    when ``index`` is odd (with usage in the stream's last chunk)."""
    stream = index % 2 == 1
    out = {"messages": [{"role": "user", "content": f"Request {index}: name three colours."}],
           "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": stream}
    if stream:
        out["stream_options"] = {"include_usage": True}
    return out
