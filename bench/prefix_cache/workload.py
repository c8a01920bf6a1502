"""The conversation: five turns about one image, each request carrying the whole history."""

from __future__ import annotations

QUESTIONS = (
    "Describe this picture in as much detail as you can.",
    "What colors do you see in it?",
    "Is there a square in it, and where is it?",
    "Describe the picture again, briefly this time.",
    "What title would you give this picture?",
)
TURNS = len(QUESTIONS)


def messages(image_url: str, answers: list[str]) -> list[dict]:
    """The history up to the next user turn: turn 1 with the image, one question per answer given so far."""
    turn = len(answers)
    if turn >= TURNS:
        raise ValueError(f"a conversation has {TURNS} turns; {turn} answers given")
    chat = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image_url}},
                                         {"type": "text", "text": QUESTIONS[0]}]}]
    for i, answer in enumerate(answers, start=1):
        chat += [{"role": "assistant", "content": answer}, {"role": "user", "content": QUESTIONS[i]}]
    return chat


def chat_body(image_url: str, answers: list[str], max_tokens: int) -> dict:
    return {"messages": messages(image_url, answers), "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
