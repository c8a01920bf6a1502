"""The workload: request ``index`` is a generated 64x64 image and one of a few short questions; the
same list drives our server and the HF baseline."""

from __future__ import annotations

from bench.common.images import make_image

QUESTIONS = (
    "What is in this picture?",
    "Describe the image in one sentence.",
    "Which colours do you see here?",
    "Is there a shape in this image? Name it.",
    "Write a short caption for this picture.",
    "What stands out in this image?",
    "Count the objects you can see.",
    "Where is the bright part of the picture?",
)


# --- workload --------------------------------------------------------------------------------
def workload(index: int):
    """(PIL image, question) of request ``index``; the same list drives the server and the HF baseline."""
    return make_image(index % 16), QUESTIONS[index % len(QUESTIONS)]


def requests_for(concurrency: int, max_requests: int) -> int:
    """Requests sent at ``concurrency``: 2C within [8, max_requests], never fewer than C."""
    return max(8, min(2 * concurrency, max_requests), concurrency)
