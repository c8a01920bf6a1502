"""One request through the router, as an outcome record (what ``analysis.check_outcome`` judges):
{"status", "retry_after", "code", "message" (an error's, cut to 160 characters), "latency_s", "body_ok",
"started_s"}. A transport error or the
per-request timeout is a status string (``timeout``, ``transport: <error class>``), never an exception."""

from __future__ import annotations

import json
import time

import httpx

from bench.overload.workload import body

MESSAGE_CHARS = 160


async def one(client: httpx.AsyncClient, url: str, index: int, max_tokens: int, t0: float) -> dict:
    """Send request ``index`` to ``url``/v1/chat/completions and read the whole answer; ``t0`` is the
    run's start (``time.monotonic``), for ``started_s``."""
    start = time.monotonic()
    record: dict = {"index": index, "started_s": round(start - t0, 3), "retry_after": None, "code": None,
                    "message": None, "body_ok": False}
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body(index, max_tokens)) as response:
            raw = (await response.aread()).decode(errors="replace")
        record["status"] = response.status_code
        record["retry_after"] = response.headers.get("Retry-After")
        if response.status_code == 200:
            record["body_ok"] = body_ok(raw, response.headers.get("content-type", ""), max_tokens)
        else:
            record["code"], record["message"] = error_fields(raw)
    except httpx.TimeoutException:
        record["status"] = "timeout"
    except httpx.HTTPError as exc:
        record["status"] = f"transport: {type(exc).__name__}"
    record["latency_s"] = round(time.monotonic() - start, 4)
    return record


def body_ok(raw: str, content_type: str, max_tokens: int) -> bool:
    """Whether a 200's body is a whole answer: a stream that ends with ``[DONE]`` and reports
    ``max_tokens`` completion tokens in its usage chunk, or a JSON completion with that many."""
    try:
        if "event-stream" in content_type:
            events = [line[len("data: "):] for line in raw.splitlines() if line.startswith("data: ")]
            if not events or events[-1] != "[DONE]":
                return False
            usage = [json.loads(e)["usage"] for e in events[:-1] if json.loads(e).get("usage")]
            return bool(usage) and usage[-1]["completion_tokens"] == max_tokens
        return json.loads(raw)["usage"]["completion_tokens"] == max_tokens
    except (ValueError, KeyError, TypeError):
        return False


def error_fields(raw: str) -> tuple[str | None, str | None]:
    """The OpenAI-style ``error.code`` and ``error.message`` (cut to ``MESSAGE_CHARS``) of an error
    body; (None, the body's start) for another body."""
    try:
        error = json.loads(raw)["error"]
        return error.get("code"), str(error.get("message"))[:MESSAGE_CHARS]
    except (ValueError, KeyError, TypeError, AttributeError):
        return None, raw[:MESSAGE_CHARS]
