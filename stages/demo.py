"""``stage demo``: make a model, start a mode's whole stack behind the router (what ``stage up``
starts), send one image+text chat request with the official ``openai`` client, print the answer and
the room's per-stage times, stop everything.

    stage demo [--mode epd|pd|colocated] [--family qwen2_vl] [--transfer mooncake|nixl] [--workdir DIR]

epd (the default): a private Redis (the embedding cache), an encoder, a prefill, a decode and the
router. The router computes the image's cache key, finds it missing, claims it for the encoder and
sends at once: the image to the encoder, the chat body with an ``image_ref`` in its place to the
prefill and the decode, with one room. pd: the router sends the body with one room to the prefill
and the decode. colocated: one server. The per-stage times are the router's ``x-epd-room`` and
``x-epd-stage-times`` answer headers (``docs/router.md``).

Everything the demo started (Redis included) is stopped when it ends, however it ends. Building the
parser imports nothing heavy.
"""

from __future__ import annotations

import argparse
import base64
import io
import os
import sys
from pathlib import Path

from stages.config import TRANSFERS
from stages.modelgen import FAMILIES, SIZES

MODES = ("epd", "pd", "colocated")
DEMO_IMAGE_SIZE = 224
QUESTION = "What is in this picture?"


def add_demo_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--family", choices=FAMILIES, default="qwen2_vl", help="model family")
    parser.add_argument("--size", choices=SIZES, default="tiny", help="model size")
    parser.add_argument("--workdir", default=os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "epd-stage"),
                        help="where the model is kept (made once) and the server logs written")
    parser.add_argument("--mode", choices=MODES, default="epd",
                        help="epd: encoder + prefill + decode and a private Redis (the embedding cache); pd: prefill "
                             "+ decode with KV moved between them; colocated: one server (all behind the router)")
    parser.add_argument("--transfer", choices=TRANSFERS, default="mooncake", help="KV transfer (pd, epd)")
    parser.add_argument("--redis-url", default=None, help="epd: this Redis instead of a private one")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens to generate")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the servers and the answer")


def run_demo(args: argparse.Namespace) -> int:
    import openai

    from stages.cli import ensure_model
    from stages.up import Stack, StackConfig, StackError

    workdir = Path(args.workdir).expanduser()
    workdir.mkdir(parents=True, exist_ok=True)
    model = ensure_model(workdir / f"{args.family}-{args.size}", args.family, args.size)
    try:
        config = StackConfig(model=model, log_dir=(workdir / f"demo-{args.mode}-logs").resolve(), mode=args.mode,
                             transfer=args.transfer, redis_url=args.redis_url, startup_timeout_s=args.timeout)
    except ValueError as exc:
        print(f"stage demo: error: {exc}", file=sys.stderr)
        return 2
    try:
        with Stack(config, say=lambda line: print(line, flush=True)) as stack:
            reply, headers = _ask(stack.base_url, args)
    except (StackError, openai.APIError) as exc:
        print(f"stage demo: error: {type(exc).__name__}: {exc} (server logs in {config.log_dir})", file=sys.stderr)
        return 1
    choice = reply.choices[0]
    print(f"answer ({choice.finish_reason}): {choice.message.content!r}")
    print(f"usage: {reply.usage.prompt_tokens} prompt + {reply.usage.completion_tokens} completion tokens "
          "(a random-weight model: the words are noise, the plumbing is real)")
    if "x-epd-room" in headers:
        print(f"room {headers['x-epd-room']}: {stage_times(headers.get('x-epd-stage-times', ''))}")
    return 0


def _ask(base_url: str, args: argparse.Namespace):  # type: ignore[no-untyped-def]
    """One image+text request through the router; the parsed reply and the answer's headers."""
    import openai

    with openai.OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=args.timeout) as client:
        image = {"type": "image_url", "image_url": {"url": _data_url(demo_image())}}
        raw = client.chat.completions.with_raw_response.create(
            model=client.models.list().data[0].id, max_tokens=args.max_tokens, temperature=0,
            messages=[{"role": "user", "content": [image, {"type": "text", "text": QUESTION}]}])
        return raw.parse(), dict(raw.headers)


def stage_times(header: str) -> str:
    """``encoder=0.0123;prefill=0.0456`` -> ``encoder 12.3 ms, prefill 45.6 ms``."""
    parts = [entry.split("=", 1) for entry in header.split(";") if "=" in entry]
    return ", ".join(f"{stage} {float(seconds) * 1000:.1f} ms" for stage, seconds in parts) or "no stage times"


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
