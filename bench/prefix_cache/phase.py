"""One phase: start a mode's stack behind the router with prefix caching on or off, warm it up, run
the conversations, stop it."""

from __future__ import annotations

import asyncio
import shutil
import time
from argparse import Namespace
from pathlib import Path

from bench.common.images import image_url, make_image
from bench.common.machine import loadavg
from bench.prefix_cache.client import conversation

WARMUP_IMAGE = 1000  # make_image index of the warm-up conversation (the timed ones use 0, 1, ...)


def run_phase(mode: str, caching: bool, args: Namespace, model: Path, out: Path, round_index: int) -> dict:
    """``mode`` (colocated or epd) with ``--prefix-caching`` or ``--no-prefix-caching``: its samples."""
    from stages.launch.stack import Stack, StackConfig

    name = f"{mode}-{'on' if caching else 'off'}"
    log_dir = out.with_name(f"{out.stem}_{name}_r{round_index}")
    shutil.rmtree(log_dir, ignore_errors=True)  # Stack appends to its logs; keep only this run's
    config = StackConfig(model=model, log_dir=log_dir.resolve(), mode=mode, transfer=args.transfer,
                         threads=args.threads, startup_timeout_s=args.startup_timeout, prefix_caching=caching,
                         stage_args=("--log-level", "warning", *args.server_arg))
    started = time.perf_counter()
    stack = Stack(config, say=lambda line: print(f"  [{name}] {line}", flush=True)).start()
    try:
        startup_s = time.perf_counter() - started
        print(f"[{name} r{round_index}] healthy after {startup_s:.1f} s; load {loadavg()}", flush=True)

        prefill = stack.urls().get("prefill")

        def talk(index: int, turns: int) -> list[dict]:
            url = image_url(make_image(index, args.image_size))
            return asyncio.run(conversation(stack.url, url, args.max_tokens, args.gap_s, args.request_timeout, turns,
                                            prefill))

        talk(WARMUP_IMAGE + round_index, 2)
        conversations = [talk(index, args.turns) for index in range(args.conversations)]
    finally:
        stack.stop()
    for samples in conversations:
        print(f"[{name}] " + "  ".join(f"t{s['turn']} {1e3 * s['ttft_s']:.0f} ms ({s['cached_tokens']}/"
                                       f"{s['prompt_tokens']} cached)" for s in samples), flush=True)
    return {"phase": name, "mode": mode, "prefix_caching": caching, "round": round_index,
            "startup_s": round(startup_s, 1), "loadavg": loadavg(), "logs": str(log_dir),
            "conversations": conversations}
