"""One phase: start the mode's stack behind the router (``stages.launch.stack``, what ``stage up``
starts), pin every process once healthy, measure (the TTFT pairs; in epd the encoder's frames per
second; the long stream alone and with a video of each ``--tpot-frames`` beside it, with the CPU
seconds of the server decoding it), stop it. A part that fails is recorded
with its error and the phase goes on to the next part."""

from __future__ import annotations

import asyncio
import itertools
import shutil
import time
import traceback
from argparse import Namespace
from pathlib import Path

from bench.common.machine import loadavg
from bench.common.pinned_stack import start_stack
from bench.common.proc import cpu_seconds
from bench.video.client import measure_encoder, measure_tpot, measure_ttft
from bench.video.workload import Pair


def _part(name: str, mode: str, run) -> dict | list:
    started = time.perf_counter()
    try:
        result = run()
    except Exception as exc:  # noqa: BLE001 - recorded, the phase goes on
        print(f"[{mode}] {name} failed: {exc}", flush=True)
        return {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-2000:]}
    print(f"[{mode}] {name} done in {time.perf_counter() - started:.1f} s", flush=True)
    return result


def run_phase(mode: str, args: Namespace, model: Path, pairs: list[Pair], seeds: itertools.count, out: Path,
              cores: dict[str, list[int]]) -> dict:
    log_dir = out.with_name(f"{out.stem}_{mode}")
    shutil.rmtree(log_dir, ignore_errors=True)
    started = time.perf_counter()
    stack, pins = start_stack(mode, args, model, log_dir.resolve(), cores)
    try:
        startup_s = time.perf_counter() - started
        print(f"[{mode}] " + ", ".join(f"{r} pid {p['pid']} on cores {p['cores'] or 'any'}" for r, p in pins.items())
              + f"; healthy after {startup_s:.1f} s; load {loadavg()}", flush=True)
        urls = {r: p.get("url") for r, p in pins.items()}
        kv_url = urls.get("colocated") or urls["prefill"]
        encoder_url = urls.get("encoder")
        cpu0 = {r: cpu_seconds(p["pid"]) for r, p in pins.items()}
        ttft = _part("TTFT pairs", mode, lambda: asyncio.run(measure_ttft(stack.url, pairs, args, kv_url, encoder_url)))
        encoder = None
        if encoder_url is not None and not args.no_encoder:
            encoder = _part("encoder frames/s", mode, lambda: asyncio.run(measure_encoder(encoder_url, args, seeds)))
        stream_pid = (pins.get("decode") or pins.get("colocated") or {}).get("pid")
        tpot = _part("stream beside a video", mode,
                     lambda: asyncio.run(measure_tpot(stack.url, args, seeds, stream_pid))) if args.tpot_trials > 0 else []
        server_cpu_s = {r: round(cpu_seconds(p["pid"]) - cpu0[r], 2) for r, p in pins.items()}
    finally:
        stack.stop()
    return {"phase": mode, "startup_s": round(startup_s, 1), "pinning": pins, "server_cpu_s": server_cpu_s,
            "loadavg_end": loadavg(), "ttft": ttft, "encoder": encoder, "tpot": tpot, "logs": str(log_dir)}
