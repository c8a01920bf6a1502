"""``stage demo``: make a model, serve it in one mode, send one image+text chat request, print the
answer, stop everything.

    stage demo [--mode colocated|pd|epd] [--family qwen2_vl] [--transfer mooncake|nixl] [--workdir DIR]

The servers are a ``stages.up.Stack`` without a router (``router=False``); the demo plays the
router's part itself, so each mode shows its wire protocol (``docs/protocol.md``):

- colocated: the chat body to the one server;
- pd: the same body, plus one bootstrap room, to the prefill and the decode at once (as SGLang's PD
  router does); the decode's answer is the reply;
- epd: a private Redis (the stack's embedded one, ``maxmemory`` set) beside an encoder, a prefill and
  a decode. The image's cache key is ``image_key(bytes, vision_fingerprint)`` (the fingerprint from the
  encoder's ``/server_info``); the demo claims the key on the encoder's behalf (its ``encoder_id``,
  as the design's dispatcher does), then sends at once: the image to the encoder, and the chat body
  with an ``image_ref`` in its place, plus one room, to the prefill and the decode. The prefill waits
  for the embedding to land in the cache.

Everything the demo started (Redis included) is stopped when it ends, however it ends. Building the
parser imports nothing heavy.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import os
import random
import sys
from pathlib import Path

from stages.config import TRANSFERS
from stages.modelgen import FAMILIES, SIZES

MODES = ("colocated", "pd", "epd")
DEMO_IMAGE_SIZE = 224
QUESTION = "What is in this picture?"
CLAIM_LEASE_S = 30.0  # the claim taken for the encoder: it renews it once the image is queued there


def add_demo_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--family", choices=FAMILIES, default="qwen2_vl", help="model family")
    parser.add_argument("--size", choices=SIZES, default="tiny", help="model size")
    parser.add_argument("--workdir", default=os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "epd-stage"),
                        help="where the model is kept (made once) and the server logs written")
    parser.add_argument("--mode", choices=MODES, default="colocated",
                        help="colocated: one server; pd: prefill + decode with KV moved between them; epd: encoder "
                             "+ prefill + decode and a private Redis (the embedding cache)")
    parser.add_argument("--transfer", choices=TRANSFERS, default="mooncake", help="KV transfer (pd, epd)")
    parser.add_argument("--redis-url", default=None, help="epd: this Redis instead of a private one")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens to generate")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the servers and the answer")


def run_demo(args: argparse.Namespace) -> int:
    from stages.cli import ensure_model
    from stages.up import Stack, StackConfig, StackError

    workdir = Path(args.workdir).expanduser()
    workdir.mkdir(parents=True, exist_ok=True)
    model = ensure_model(workdir / f"{args.family}-{args.size}", args.family, args.size)
    try:
        config = StackConfig(model=model, log_dir=(workdir / f"demo-{args.mode}-logs").resolve(), mode=args.mode,
                             transfer=args.transfer, redis_url=args.redis_url, startup_timeout_s=args.timeout,
                             router=False)
    except ValueError as exc:
        print(f"stage demo: error: {exc}", file=sys.stderr)
        return 2
    import httpx

    try:
        with Stack(config, say=lambda line: print(line, flush=True)) as stack:
            reply = asyncio.run(_ask(stack, args))
    except (StackError, RuntimeError, httpx.HTTPError) as exc:
        print(f"stage demo: error: {type(exc).__name__}: {exc} (server logs in {config.log_dir})", file=sys.stderr)
        return 1
    choice = reply["choices"][0]
    print(f"answer ({choice['finish_reason']}): {choice['message']['content']!r}")
    print(f"usage: {reply['usage']['prompt_tokens']} prompt + {reply['usage']['completion_tokens']} completion tokens "
          "(a random-weight model: the words are noise, the plumbing is real)")
    return 0


async def _ask(stack, args: argparse.Namespace) -> dict:  # type: ignore[no-untyped-def]
    """Send the one request the way ``args.mode`` takes it; the answering server's JSON."""
    import httpx

    urls, image = stack.urls(), demo_image()
    async with httpx.AsyncClient(timeout=args.timeout) as client:
        if args.mode == "colocated":
            body = _chat({"type": "image_url", "image_url": {"url": _data_url(image)}}, args.max_tokens)
            return _json(await client.post(f"{urls['colocated']}/v1/chat/completions", json=body))
        room = {"bootstrap_host": "127.0.0.1", "bootstrap_port": _bootstrap_port(stack),
                "bootstrap_room": random.getrandbits(63)}
        if args.mode == "pd":
            body = {**_chat({"type": "image_url", "image_url": {"url": _data_url(image)}}, args.max_tokens), **room}
            return await _prefill_and_decode(client, urls, body)
        key = await _claim_for_encoder(client, urls["encoder"], stack.redis_url, image)
        part = {"type": "image_ref", "image_ref": {"key": key, "width": DEMO_IMAGE_SIZE, "height": DEMO_IMAGE_SIZE}}
        body = {**_chat(part, args.max_tokens), **room}
        encode = client.post(f"{urls['encoder']}/v1/encode", json={"room": room["bootstrap_room"], "images": [
            {"key": key, "data": base64.b64encode(image).decode()}]})
        encoded, answer = await asyncio.gather(encode, _prefill_and_decode(client, urls, body))
        print(f"encoder: {_json(encoded)['images'][0]}")
        return answer


async def _claim_for_encoder(client, encoder_url: str, redis_url: str, image: bytes) -> str:  # type: ignore[no-untyped-def]
    """The image's cache key under the encoder's fingerprint, claimed for that encoder (single flight:
    from here on a prefill that asks for the key waits for it instead of being refused)."""
    from cache.config import MIB, CacheConfig
    from cache.keys import image_key
    from cache.store import EmbeddingCache

    info = _json(await client.get(f"{encoder_url}/server_info"))
    key = image_key(image, info["vision_fingerprint"])
    async with EmbeddingCache(CacheConfig(url=redis_url, budget_bytes=64 * MIB, ttl_s=3600.0)) as cache:
        if not await cache.claim(key, info["encoder_id"], CLAIM_LEASE_S):
            print(f"image {key[:12]}... is cached or being encoded already")
    return key


async def _prefill_and_decode(client, urls: dict[str, str], body: dict) -> dict:  # type: ignore[no-untyped-def]
    """The same body to both halves at once; the decode's answer (the prefill's is its first token)."""
    prefill, decode = await asyncio.gather(client.post(f"{urls['prefill']}/v1/chat/completions", json=body),
                                           client.post(f"{urls['decode']}/v1/chat/completions", json=body))
    _json(prefill)
    return _json(decode)


def _bootstrap_port(stack) -> int:  # type: ignore[no-untyped-def]
    return next(c.spec.other_ports[0] for c in stack.children if c.spec.role == "prefill")


def _chat(image_part: dict, max_tokens: int) -> dict:
    return {"messages": [{"role": "user", "content": [image_part, {"type": "text", "text": QUESTION}]}],
            "max_tokens": max_tokens, "temperature": 0}


def _json(response) -> dict:  # type: ignore[no-untyped-def]
    if response.status_code != 200:
        raise RuntimeError(f"{response.request.url} answered {response.status_code}: {response.text[:2000]}")
    return response.json()


def demo_image(size: int = DEMO_IMAGE_SIZE) -> bytes:
    """A PNG (a red disc and a blue square on a gradient), ``size`` x ``size`` pixels."""
    from PIL import Image, ImageDraw

    image = Image.linear_gradient("L").resize((size, size)).convert("RGB")
    draw = ImageDraw.Draw(image)
    draw.ellipse((size // 8, size // 8, size // 2, size // 2), fill=(220, 30, 30))
    draw.rectangle((size // 2, size // 2, size - size // 8, size - size // 8), fill=(30, 60, 220))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def _data_url(image: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(image).decode()
