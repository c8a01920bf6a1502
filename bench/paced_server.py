"""A chat endpoint with known timing, for checking benchmark clients against the truth: every streamed
request gets its first token ``--ttft-ms`` after its body has arrived, then one token every
``--itl-ms`` up to its ``max_tokens`` (or ``max_completion_tokens``), then usage and ``[DONE]``. No
model and almost no CPU, so what a client measures beyond those delays is the client's own (and the
event loop's wake-up latency on a busy machine).

    python bench/paced_server.py --port 8000 --ttft-ms 100 --itl-ms 20 [--model paced]

Serves ``POST /v1/chat/completions`` (``stream: true`` only), ``GET /v1/models``, ``GET /health``, on
127.0.0.1. Used by ``bench/check_against_aiperf.py --server paced``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from aiohttp import web

from contract.paths import CHAT_PATH, HEALTH_PATH, MODELS_PATH

DEFAULT_MAX_TOKENS = 16


def chunk(model: str, delta: dict | None, finish: str | None = None, usage: dict | None = None) -> bytes:
    body = {"id": "chatcmpl-paced", "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]}
    if usage is not None:
        body["usage"] = usage
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n".encode()


def build(model: str, ttft_s: float, itl_s: float) -> web.Application:
    """The app; each stream's token times are fixed from the moment its body has been read."""

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        start = time.perf_counter()
        tokens = int(body.get("max_tokens") or body.get("max_completion_tokens") or DEFAULT_MAX_TOKENS)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(chunk(model, {"role": "assistant", "content": ""}))
        for index in range(tokens):  # token i is due at start + ttft + i * itl, whatever the last write cost
            await asyncio.sleep(max(0.0, start + ttft_s + index * itl_s - time.perf_counter()))
            await response.write(chunk(model, {"content": f" t{index}"}))
        await response.write(chunk(model, {}, "length"))
        usage = {"prompt_tokens": 1, "completion_tokens": tokens, "total_tokens": tokens + 1}
        await response.write(chunk(model, None, usage=usage) + b"data: [DONE]\n\n")
        return response

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": model, "object": "model", "owned_by": "paced"}]})

    async def health(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app = web.Application(client_max_size=64 * 2**20)
    app.router.add_post(CHAT_PATH, chat)
    app.router.add_get(MODELS_PATH, models)
    app.router.add_get(HEALTH_PATH, health)
    return app


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--ttft-ms", type=float, default=100.0, help="body read -> first token")
    p.add_argument("--itl-ms", type=float, default=20.0, help="between tokens")
    p.add_argument("--model", default="paced", help="model id served")
    args = p.parse_args(argv)
    web.run_app(build(args.model, args.ttft_ms / 1e3, args.itl_ms / 1e3), host="127.0.0.1", port=args.port,
                print=None, access_log=None)


if __name__ == "__main__":
    main()
