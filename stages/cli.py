"""The ``stage`` command.

    stage serve colocated --model DIR [--host 127.0.0.1] [--port 8000] [...]
    stage make-model --family qwen2_vl --size tiny --out DIR
    stage demo [--mode colocated|pd] [--family qwen2_vl] [--workdir DIR]

``serve`` takes one role per subcommand; a role is one entry in ``SERVE_ROLES`` (a function adding
its flags and a function running it), so prefill, decode and encoder servers plug in the same way.
Flag defaults come from the config dataclasses. The process helpers at the bottom (free port, wait
for /health, stop) are shared by ``demo`` and the tests.
"""

from __future__ import annotations

import argparse
import base64
import io
import logging
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path

from stages.modelgen import FAMILIES, SIZES, TEXT_MODELS, VISION_TOWERS

HEALTH_POLL_S = 0.25


# --- serve -----------------------------------------------------------------------------------
def _defaults(cls) -> dict:  # type: ignore[no-untyped-def]
    return {f.name: f.default for f in fields(cls)}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Flags of ``EngineConfig``, shared by every role that runs a model."""
    from stages.engine.config import DTYPES, EngineConfig

    d = _defaults(EngineConfig)
    g = parser.add_argument_group("engine")
    g.add_argument("--model", required=True, help="checkpoint directory (Hugging Face layout)")
    g.add_argument("--dtype", choices=sorted(DTYPES), default=d["dtype"], help="weights and KV dtype")
    g.add_argument("--threads", type=int, default=d["threads"], help="torch CPU threads")
    g.add_argument("--block-size", type=int, default=d["block_size"], help="tokens per KV block")
    g.add_argument("--kv-cache-mib", type=int, default=d["kv_cache_mib"], help="KV pool size")
    g.add_argument("--max-num-seqs", type=int, default=d["max_num_seqs"], help="requests per batch")
    g.add_argument("--max-batched-tokens", type=int, default=d["max_batched_tokens"], help="tokens per step")
    g.add_argument("--max-model-len", type=int, default=d["max_model_len"],
                   help="context length; None: the model's max_position_embeddings")
    g.add_argument("--seed", type=int, default=d["seed"], help="torch seed at startup")


def engine_config(args: argparse.Namespace):  # -> EngineConfig
    from stages.engine.config import EngineConfig

    return EngineConfig(model=args.model, dtype=args.dtype, block_size=args.block_size, kv_cache_mib=args.kv_cache_mib,
                        max_num_seqs=args.max_num_seqs, max_batched_tokens=args.max_batched_tokens,
                        max_model_len=args.max_model_len, threads=args.threads, seed=args.seed)


def add_http_args(parser: argparse.ArgumentParser, default_port: int) -> None:
    """Flags of a server answering OpenAI chat requests (colocated now; decode in EPD mode later)."""
    from stages.api.images import ImageLimits

    limits = _defaults(ImageLimits)
    g = parser.add_argument_group("http")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (loopback unless told otherwise)")
    g.add_argument("--port", type=int, default=default_port, help="port to bind (0: any free port)")
    g.add_argument("--served-model-name", default=None, help="model id in the API; None: the model directory's name")
    g.add_argument("--max-images-per-request", type=int, default=limits["max_images"], help="images per request")
    g.add_argument("--max-image-pixels", type=int, default=limits["max_pixels"], help="width * height per image")
    g.add_argument("--max-image-bytes", type=int, default=limits["max_bytes"], help="encoded bytes per image")
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"], help="log level")


def _colocated_args(parser: argparse.ArgumentParser) -> None:
    add_engine_args(parser)
    add_http_args(parser, default_port=8000)


def _serve_colocated(args: argparse.Namespace) -> int:
    from stages.api.images import ImageLimits
    from stages.colocated import ServerConfig, serve

    try:
        limits = ImageLimits(args.max_images_per_request, args.max_image_pixels, args.max_image_bytes)
        config = ServerConfig(engine_config(args), host=args.host, port=args.port,
                              served_model_name=args.served_model_name, limits=limits, log_level=args.log_level)
    except ValueError as exc:  # the message names the flag to change
        print(f"stage serve colocated: error: {exc}", file=sys.stderr)
        return 2
    serve(config)
    return 0


def _disagg_args(parser: argparse.ArgumentParser, role: str) -> None:
    from stages.disagg.config import DisaggConfig

    add_engine_args(parser)
    add_http_args(parser, default_port=8100 if role == "prefill" else 8200)
    d = _defaults(DisaggConfig)
    g = parser.add_argument_group("disaggregation")
    g.add_argument("--transfer", choices=["mooncake", "nixl"], default="mooncake", help="KV transfer backend")
    g.add_argument("--transfer-host", default=None,
                   help="address peers dial for KV transfer; default: --host (must be set when --host is a wildcard)")
    g.add_argument("--transfer-protocol", default="tcp", help="mooncake: tcp or rdma")
    g.add_argument("--transfer-device", default="", help="RDMA device names (mooncake rdma)")
    g.add_argument("--transfer-timeout-s", type=float, default=10.0, help="deadline of one KV write")
    g.add_argument("--pair-timeout-s", type=float, default=d["pair_timeout_s"],
                   help="a room's other half must arrive within this")
    if role == "prefill":
        g.add_argument("--bootstrap-host", default=d["bootstrap_host"], help="bootstrap endpoint address")
        g.add_argument("--bootstrap-port", type=int, default=8998, help="bootstrap endpoint port (0: any)")
    else:
        g.add_argument("--kv-timeout-s", type=float, default=d["kv_timeout_s"],
                       help="KV request sent -> KV ready, at most")
        g.add_argument("--accept-timeout-s", type=float, default=d["accept_timeout_s"],
                       help="KV request sent -> accepted by the prefill, at most")
        g.add_argument("--abort-grace-s", type=float, default=d["abort_grace_s"],
                       help="hold an aborted room's blocks this long when the prefill cannot confirm")


def _serve_disagg(args: argparse.Namespace, role: str) -> int:
    from stages.api.images import ImageLimits
    from stages.disagg.config import DisaggConfig
    from stages.disagg.server import StageServerConfig, serve
    from transfer.base import TransferConfig

    try:
        disagg = DisaggConfig(
            bootstrap_host=getattr(args, "bootstrap_host", "127.0.0.1"),
            bootstrap_port=getattr(args, "bootstrap_port", 0),
            pair_timeout_s=args.pair_timeout_s,
            kv_timeout_s=getattr(args, "kv_timeout_s", DisaggConfig.kv_timeout_s),
            accept_timeout_s=getattr(args, "accept_timeout_s", DisaggConfig.accept_timeout_s),
            abort_grace_s=getattr(args, "abort_grace_s", DisaggConfig.abort_grace_s),
            fault=os.environ.get("EPD_TEST_FAULT", ""),
        )
        config = StageServerConfig(
            role=role, engine=engine_config(args), transfer=args.transfer,
            transfer_config=TransferConfig(host=args.transfer_host or args.host, protocol=args.transfer_protocol,
                                           device=args.transfer_device, timeout_s=args.transfer_timeout_s),
            disagg=disagg, host=args.host, port=args.port, served_model_name=args.served_model_name,
            limits=ImageLimits(args.max_images_per_request, args.max_image_pixels, args.max_image_bytes),
            log_level=args.log_level,
        )
    except ValueError as exc:  # the message names the flag to change
        print(f"stage serve {role}: error: {exc}", file=sys.stderr)
        return 2
    serve(config)
    return 0


# role -> (add its flags, run it); each role's module is imported only when that role runs
SERVE_ROLES: dict[str, tuple[Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = {
    "colocated": (_colocated_args, _serve_colocated),
    "prefill": (lambda p: _disagg_args(p, "prefill"), lambda a: _serve_disagg(a, "prefill")),
    "decode": (lambda p: _disagg_args(p, "decode"), lambda a: _serve_disagg(a, "decode")),
}


# --- make-model and demo ---------------------------------------------------------------------
def _make_model(args: argparse.Namespace) -> int:
    from stages.modelgen import make_model

    print(make_model(args.family, args.size, args.out, seed=args.seed, vision=args.vision, text=args.text))
    return 0


def _demo(args: argparse.Namespace) -> int:
    """Colocated: one server. PD: a prefill and a decode server joined by one bootstrap room, the same
    request sent to both at once (as SGLang's PD router does); the decode's answer is the reply."""
    import random
    from concurrent.futures import ThreadPoolExecutor

    from openai import OpenAI

    workdir = Path(args.workdir).expanduser()
    workdir.mkdir(parents=True, exist_ok=True)
    model = ensure_model(workdir / f"{args.family}-{args.size}", args.family, args.size)
    roles = ["colocated"] if args.mode == "colocated" else ["prefill", "decode"]
    bootstrap_port = free_port()
    servers: list[tuple[str, str, subprocess.Popen, Path]] = []
    try:
        for role in roles:
            port, log_path = free_port(), workdir / f"{role}.log"
            flags = ["--model", str(model), "--port", str(port)]
            if role != "colocated":
                flags += ["--transfer", args.transfer]
            if role == "prefill":
                flags += ["--bootstrap-port", str(bootstrap_port)]
            print(f"starting `stage serve {role}` on 127.0.0.1:{port} (log: {log_path})", flush=True)
            with open(log_path, "wb") as log_file:
                proc = subprocess.Popen([sys.executable, "-m", "stages.cli", "serve", role, *flags],
                                        stdout=log_file, stderr=subprocess.STDOUT)
            servers.append((role, f"http://127.0.0.1:{port}", proc, log_path))
        for _, url, proc, log_path in servers:
            wait_healthy(url, proc, args.timeout)
        clients = [OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=args.timeout)
                   for _, url, _, _ in servers]
        extra = {}
        if args.mode == "pd":
            extra = {"bootstrap_host": "127.0.0.1", "bootstrap_port": bootstrap_port,
                     "bootstrap_room": random.getrandbits(63)}
        ask = lambda client: client.chat.completions.create(  # noqa: E731
            model=client.models.list().data[0].id,
            messages=[{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": demo_image_url()}},
                {"type": "text", "text": "What is in this picture?"}]}],
            max_tokens=args.max_tokens, temperature=0, extra_body=extra)
        with ThreadPoolExecutor(len(clients)) as pool:
            reply = list(pool.map(ask, clients))[-1]
    except (RuntimeError, TimeoutError):
        for _, _, _, log_path in servers:
            print(log_path.read_text(errors="replace")[-3000:], file=sys.stderr)
        raise
    finally:
        for _, _, proc, _ in servers:
            stop_process(proc)
    print(f"answer ({reply.choices[0].finish_reason}): {reply.choices[0].message.content!r}")
    print(f"usage: {reply.usage.prompt_tokens} prompt + {reply.usage.completion_tokens} completion tokens "
          "(a random-weight model: the words are noise, the plumbing is real)")
    return 0


def ensure_model(path: Path, family: str, size: str) -> Path:
    """A generated checkpoint at ``path``, made (atomically) if it is not there yet."""
    if (path / "config.json").exists():
        return path
    from stages.modelgen import make_model

    print(f"making a random-weight {family} ({size}) checkpoint in {path}", flush=True)
    partial = path.with_name(path.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    make_model(family, size, partial)
    partial.rename(path)
    return path


def demo_image_url(size: int = 224) -> str:
    """A PNG (a red disc and a blue square on a gradient) as a data: URL."""
    from PIL import Image, ImageDraw

    image = Image.linear_gradient("L").resize((size, size)).convert("RGB")
    draw = ImageDraw.Draw(image)
    draw.ellipse((size // 8, size // 8, size // 2, size // 2), fill=(220, 30, 30))
    draw.rectangle((size // 2, size // 2, size - size // 8, size - size // 8), fill=(30, 60, 220))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


# --- process helpers -------------------------------------------------------------------------
def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    """Poll ``url``/health until it answers 200. Raises RuntimeError if the process exits first and
    TimeoutError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode} before it was healthy")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(HEALTH_POLL_S)
    raise TimeoutError(f"{url}/health did not answer 200 within {timeout_s:.0f} s")


def stop_process(proc: subprocess.Popen, timeout_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL after ``timeout_s``."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout_s)


# --- parser ----------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stage", description="Encode / prefill / decode stage servers.")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run one stage server")
    roles = serve.add_subparsers(dest="role", required=True)
    for role, (add_args, run) in SERVE_ROLES.items():
        role_parser = roles.add_parser(role, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        add_args(role_parser)
        role_parser.set_defaults(run=run)

    make = commands.add_parser("make-model", help="write a random-weight checkpoint for tests and benchmarks")
    make.add_argument("--family", choices=FAMILIES, required=True)
    make.add_argument("--size", choices=SIZES, default="tiny")
    make.add_argument("--out", required=True)
    make.add_argument("--seed", type=int, default=0)
    make.add_argument("--vision", choices=VISION_TOWERS, default=None, help="LLaVA only")
    make.add_argument("--text", choices=TEXT_MODELS, default=None, help="LLaVA only")
    make.set_defaults(run=_make_model)

    demo = commands.add_parser("demo", help="make a model, serve it, send one image+text chat request",
                               formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    demo.add_argument("--family", choices=FAMILIES, default="qwen2_vl", help="model family")
    demo.add_argument("--size", choices=SIZES, default="tiny", help="model size")
    demo.add_argument("--workdir", default=os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "epd-stage"),
                      help="where the model is kept (made once) and the server log written")
    demo.add_argument("--mode", choices=["colocated", "pd"], default="colocated",
                      help="one colocated server, or a prefill and a decode server with KV moved between them")
    demo.add_argument("--transfer", choices=["mooncake", "nixl"], default="mooncake", help="KV transfer (pd mode)")
    demo.add_argument("--max-tokens", type=int, default=32, help="tokens to generate")
    demo.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the server and the answer")
    demo.set_defaults(run=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    level = args.log_level.upper() if args.command == "serve" else "WARNING"  # demo prints its own lines
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
