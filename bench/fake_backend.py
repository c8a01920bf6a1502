"""A fake prefill + decode pair for router benchmarks: the routes and answer shapes of
``stage serve prefill|decode`` (and what sglang-router and vllm-router ask of their workers), with
no model behind them, so that what a router costs is not buried under model time.

    python bench/fake_backend.py --prefill-port P --decode-port D --bootstrap-port B [--tokens 8] [--itl-ms 2]

One process, one event loop, two listening ports. Every worker route a router reads at startup or
while checking health answers at once (``/health``, ``/v1/models``, ``/server_info`` with a role, a
fingerprint and, on the prefill, the bootstrap address; ``/get_server_info``, ``/get_model_info``).
``POST /v1/chat/completions``:
- prefill: a ``chat.completion`` with one token and ``finish_reason: length`` (what ours answers),
  echoing any ``kv_transfer_params`` (vLLM's two-step PD flow reads them back for the decode);
- decode: ``--tokens`` tokens (each ``--token-bytes`` of text); a stream sends the role chunk at once
  and each token ``--itl-ms`` after the previous one (the first too, so a router that buffers shows in
  the time to the first token), then the finish and usage chunks and ``[DONE]``; a JSON answer at once.
``GET /bench/stats`` counts requests per role and how many carried ``bootstrap_room`` and
``kv_transfer_params`` (the bench checks every router reached both stages once per request), and
the decode's streamed token chunks its socket took (``decode_chunks_written``: a reader that stalls
stalls it).
Loopback only; the process ends on SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import time
from collections import Counter

from aiohttp import web

from contract.paths import ABORT_PATH, CHAT_PATH, ENCODE_PATH, HEALTH_PATH, MODELS_PATH, SERVER_INFO_PATH

MODEL = "fake-model"
CARD = {"object": "list", "data": [{"id": MODEL, "object": "model", "created": 0, "owned_by": "bench"}]}


def completion(content: str, tokens: int, prompt_tokens: int = 10, extra: dict | None = None) -> dict:
    return {"id": "chatcmpl-fake", "object": "chat.completion", "created": int(time.time()), "model": MODEL,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "length"}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": tokens,
                      "total_tokens": prompt_tokens + tokens}, **(extra or {})}


def chunk(delta: dict, finish: str | None = None, usage: dict | None = None) -> bytes:
    body = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": 0, "model": MODEL,
            "choices": [] if usage else [{"index": 0, "delta": delta, "finish_reason": finish}]}
    if usage:
        body["usage"] = usage
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


def make_app(role: str, args: argparse.Namespace, stats: Counter) -> web.Application:
    info = {"role": role, "model": MODEL, "fingerprint": {"model": MODEL, "block_size": 16}, "kv_blocks": {"used": 0}}
    if role == "prefill":
        info["bootstrap"] = {"host": "127.0.0.1", "port": args.bootstrap_port}
    itl_s, tokens, text = args.itl_ms / 1000, args.tokens, "a" * args.token_bytes

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        stats[f"{role}_requests"] += 1
        stats[f"{role}_with_room"] += "bootstrap_room" in body
        stats[f"{role}_with_kv_params"] += "kv_transfer_params" in body
        if role == "prefill":
            extra = {"kv_transfer_params": body["kv_transfer_params"]} if "kv_transfer_params" in body else None
            if not body.get("stream"):
                return web.json_response(completion("a", 1, extra=extra))
            return await stream(request, 1, 0.0)
        if not body.get("stream"):
            return web.json_response(completion(text * tokens, tokens))
        return await stream(request, tokens, itl_s)

    async def stream(request: web.Request, n: int, gap_s: float) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        await response.write(chunk({"role": "assistant", "content": ""}))
        for _ in range(n):
            if gap_s:
                await asyncio.sleep(gap_s)
            await response.write(chunk({"content": text}))
            stats[f"{role}_chunks_written"] += 1
        await response.write(chunk({}, "length"))
        await response.write(chunk({}, usage={"prompt_tokens": 10, "completion_tokens": n, "total_tokens": 10 + n}))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def ok(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app = web.Application()
    app.router.add_post(CHAT_PATH, chat)
    app.router.add_get(HEALTH_PATH, ok)
    app.router.add_get("/health_generate", ok)
    app.router.add_get(MODELS_PATH, lambda _: _json(CARD))
    app.router.add_get(SERVER_INFO_PATH, lambda _: _json(info))
    app.router.add_get("/get_server_info", lambda _: _json(info))
    app.router.add_get("/get_model_info", lambda _: _json({"model_path": MODEL, "is_generation": True}))
    app.router.add_get("/bench/stats", lambda _: _json(dict(stats)))
    return app


def make_encoder_app(stats: Counter) -> web.Application:
    """A fake encoder (``--encoder-port``): ``/server_info`` with its id and vision fingerprint, and
    ``POST /v1/encode`` / ``/v1/abort`` answered at once (nothing is encoded nor cached: the fake
    prefill waits for no embedding)."""
    info = {"role": "encoder", "model": MODEL, "encoder_id": "fake-encoder", "vision_fingerprint": "f" * 64}

    async def encode(request: web.Request) -> web.Response:
        body = await request.json()
        stats["encoder_requests"] += 1
        stats["encoder_images"] += len(body.get("images") or ())
        return web.json_response({"room": body.get("room"), "images": len(body.get("images") or ())})

    async def ok(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app = web.Application(client_max_size=64 << 20)
    app.router.add_post(ENCODE_PATH, encode)
    app.router.add_post(ABORT_PATH, ok)
    app.router.add_get(HEALTH_PATH, ok)
    app.router.add_get(SERVER_INFO_PATH, lambda _: _json(info))
    app.router.add_get("/bench/stats", lambda _: _json(dict(stats)))
    return app


async def _json(body: dict) -> web.Response:
    return web.json_response(body)


async def main(args: argparse.Namespace) -> None:
    stats: Counter = Counter()
    runners = []
    for role, port in (("prefill", args.prefill_port), ("decode", args.decode_port)):
        runner = web.AppRunner(make_app(role, args, stats), access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        runners.append(runner)
    if args.encoder_port:
        runner = web.AppRunner(make_encoder_app(stats), access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", args.encoder_port).start()
        runners.append(runner)
    print(f"fake prefill on {args.prefill_port}, decode on {args.decode_port}", flush=True)
    await serve_until_signalled(runners)


async def serve_until_signalled(runners: list[web.AppRunner]) -> None:
    """Serve until SIGTERM or SIGINT, then stop every runner."""
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    for runner in runners:
        await runner.cleanup()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefill-port", type=int, required=True)
    parser.add_argument("--decode-port", type=int, required=True)
    parser.add_argument("--bootstrap-port", type=int, required=True, help="reported in the prefill's /server_info")
    parser.add_argument("--encoder-port", type=int, default=0, help="also a fake encoder on this port (0: none)")
    parser.add_argument("--tokens", type=int, default=8, help="tokens per decode answer")
    parser.add_argument("--itl-ms", type=float, default=2.0, help="gap before each streamed token (decode)")
    parser.add_argument("--token-bytes", type=int, default=1, help="characters of each token's text")
    asyncio.run(main(parser.parse_args()))
