"""``stage demo``: make a model, start a mode's whole stack behind the router (what ``stage up``
starts), send one image+text chat request with the official ``openai`` client, print the answer and
the room's per-stage times, stop everything.

    stage demo [--mode epd|pd|colocated] [--model DIR | --family qwen2_vl] [--device DEVICE[,...]]
               [--transfer mooncake|nixl] [--workdir DIR]

epd (the default): a private Redis (the embedding cache), an encoder, a prefill, a decode and the
router. The router computes the image's cache key, finds it missing, claims it for the encoder and
sends at once: the image to the encoder, the chat body with an ``image_ref`` in its place to the
prefill and the decode, with one room. pd: the router sends the body with one room to the prefill
and the decode. colocated: one server. The per-stage times are the router's ``x-epd-room`` and
``x-epd-stage-times`` answer headers (``docs/router.md``).

Devices and transfer are ``stage up``'s (``stages.launch.placement``): on a machine whose torch sees a
GPU the stages run there, and a combination that cannot work here is one line, exit 2, before
anything starts. It prints the prompt, then the answer with what its ``finish_reason`` means, its usage and the stage
times, all before the stack stops. The model is the one ``stage up`` makes by default (same family
and size, kept in the same cache dir); the servers' logs go to a new run directory under
``WORKDIR/logs``, of which the last 10 runs are kept (``stages.launch.run_logs``).

Everything the demo started (Redis included) is stopped when it ends, however it ends. Building the
parser imports nothing heavy.
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import io
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from stages.config import TRANSFERS
from stages.launch.models import DEFAULT_FAMILY, DEFAULT_SIZE, cache_dir, ensure_model
from stages.launch.run_logs import new_run_dir
from stages.launch.stack import MODES, Stack, StackConfig, StackError
from stages.launch.placement import Machine
from stages.launch.up import add_device_arg, add_redis_args, placed, placement_line, stack_redis_url
from stages.model_dir import check_model_dir
from stages.modelgen import FAMILIES, SIZES

if TYPE_CHECKING:  # openai is imported where used: the CLI stays fast
    from openai.types.chat import (ChatCompletion, ChatCompletionContentPartImageParam,
                                   ChatCompletionContentPartTextParam)

DEMO_IMAGE_SIZE = 224
QUESTION = "What is in this picture?"
IMAGE_DESCRIPTION = "a red disc and a blue square on a gradient"
FINISH_REASONS = {
    "length": "the answer was cut at --max-tokens ({max_tokens} tokens)",
    "stop": "the model ended the answer itself (an end-of-sequence token or a stop string)",
}


def add_demo_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="checkpoint directory (e.g. a downloaded Qwen2.5-VL); default: "
                        "the generated --family model of --size, made on first run under --workdir")
    parser.add_argument("--family", choices=FAMILIES, default=DEFAULT_FAMILY, help="model family")
    parser.add_argument("--size", choices=SIZES, default=DEFAULT_SIZE, help="model size (stage up's default too)")
    parser.add_argument("--workdir", default=str(cache_dir()),
                        help="where the model is kept (made once; shared with stage up) and the server logs written "
                             "(WORKDIR/logs, the last 10 runs kept)")
    parser.add_argument("--mode", choices=MODES, default="epd",
                        help="epd: encoder + prefill + decode and a private Redis (the embedding cache); pd: prefill "
                             "+ decode with KV moved between them; colocated: one server (all behind the router)")
    parser.add_argument("--transfer", choices=TRANSFERS, default=None,
                        help="KV transfer (pd, epd); default: mooncake where its installed build can move the KV's "
                             "memory (a CUDA build for GPU memory), else nixl")
    add_device_arg(parser)
    add_redis_args(parser, "a private one")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens to generate")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the servers and the answer")


def run_demo(args: argparse.Namespace) -> int:
    import openai

    workdir = Path(args.workdir).expanduser()
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        config = StackConfig(model=Path(args.model or workdir / f"{args.family}-{args.size}"), log_dir=Path(),
                             mode=args.mode, redis_url=stack_redis_url(args), startup_timeout_s=args.timeout)
        if args.model is not None:
            check_model_dir(config.model, tokenizer=True)
        config = placed(config, args, Machine.here())  # imports torch: after the cheap checks
    except ValueError as exc:
        print(f"stage demo: error: {exc}", file=sys.stderr)
        return 2
    model = config.model if args.model is not None else ensure_model(config.model, args.family, args.size)
    config = dataclasses.replace(config, model=model,
                                 log_dir=new_run_dir(workdir / "logs", f"demo-{args.mode}").resolve())
    print(f"{args.mode} mode, model {config.model}: {placement_line(config)}", flush=True)
    try:
        with Stack(config, say=lambda line: print(line, flush=True)) as stack:
            print(f"prompt: [image: {DEMO_IMAGE_SIZE}x{DEMO_IMAGE_SIZE} PNG, {IMAGE_DESCRIPTION}] {QUESTION}",
                  flush=True)
            reply, headers = _ask(stack.base_url, args)
            print(describe_answer(reply, headers, args.max_tokens, generated=args.model is None), flush=True)
    except (StackError, openai.APIError) as exc:
        print(f"stage demo: error: {type(exc).__name__}: {exc} (server logs in {config.log_dir})", file=sys.stderr)
        return 1
    return 0


def describe_answer(reply: ChatCompletion, headers: dict, max_tokens: int, generated: bool = True) -> str:
    """The answer's lines: its text and finish_reason, what that reason means, the usage (``generated``:
    from a random-weight model, said so), and the room's per-stage times when the router sent them."""
    choice = reply.choices[0]
    meaning = FINISH_REASONS.get(choice.finish_reason, "see the OpenAI chat completions reference")
    usage = (f"{reply.usage.prompt_tokens} prompt + {reply.usage.completion_tokens} completion tokens"
             if reply.usage is not None else "not reported")
    lines = [f"answer ({choice.finish_reason}): {choice.message.content!r}",
             f"finish_reason {choice.finish_reason!r}: {meaning.format(max_tokens=max_tokens)}",
             f"usage: {usage}" + (" (a random-weight model: the words are noise, the plumbing is real)"
                                  if generated else "")]
    if "x-epd-room" in headers:
        lines.append(f"room {headers['x-epd-room']}: {stage_times(headers.get('x-epd-stage-times', ''))}")
    return "\n".join(lines)


def _ask(base_url: str, args: argparse.Namespace) -> tuple[ChatCompletion, dict[str, str]]:
    """One image+text request through the router; the parsed reply and the answer's headers."""
    import openai

    with openai.OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=args.timeout) as client:
        image: ChatCompletionContentPartImageParam = {"type": "image_url", "image_url": {"url": _data_url(demo_image())}}
        text: ChatCompletionContentPartTextParam = {"type": "text", "text": QUESTION}
        raw = client.chat.completions.with_raw_response.create(
            model=client.models.list().data[0].id, max_tokens=args.max_tokens, temperature=0,
            messages=[{"role": "user", "content": [image, text]}])
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
