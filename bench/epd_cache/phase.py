"""One phase: start the mode's stack, measure (the TTFT sequence, then for epd the burst), stop it."""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from argparse import Namespace
from pathlib import Path

from bench.common.machine import loadavg
from bench.common.meter import CpuMeter
from bench.common.proc import cpu_seconds
from bench.epd_cache.client import EpdProbe, measure_burst, measure_ttft
from bench.epd_cache.landing import LandingClock
from bench.common.pinned_stack import start_stack
from bench.epd_cache.workload import ImageSource, Pair


def run_phase(mode: str, args: Namespace, model: Path, pairs: list[Pair], source: ImageSource, out: Path,
              round_index: int, cores: dict[str, list[int]]) -> dict:
    """Start the mode's stack, measure, stop it."""
    import httpx

    log_dir = out.with_name(f"{out.stem}_{mode}_r{round_index}")
    shutil.rmtree(log_dir, ignore_errors=True)  # Stack appends to its logs; keep only this run's
    started = time.perf_counter()
    stack, pins = start_stack(mode, args, model, log_dir.resolve(), cores)
    clock = None
    try:
        startup_s = time.perf_counter() - started
        print(f"[{mode} r{round_index}] " + ", ".join(f"{r} pid {p['pid']} on cores {p['cores'] or 'any'}"
                                                     for r, p in pins.items())
              + f"; healthy after {startup_s:.1f} s; load {loadavg()}", flush=True)
        probe, clock = None, None
        if mode == "epd":
            urls = stack.urls()
            fingerprint = httpx.get(f"{urls['encoder']}/server_info", timeout=10).json()["vision_fingerprint"]
            clock = LandingClock(urls["redis"])
            probe = EpdProbe(urls["encoder"], urls["prefill"], urls["redis"], fingerprint, clock)
        cpu0 = {r: cpu_seconds(p["pid"]) for r, p in pins.items()}
        meter = CpuMeter({os.getpid(), *(p["pid"] for p in pins.values())}, cpu_key="client_cpu_s")
        samples = asyncio.run(measure_ttft(stack.url, pairs, args, probe, {r: p["pid"] for r, p in pins.items()}))
        burst = asyncio.run(measure_burst(stack.url, source, args, probe)) if probe is not None else None
        usage = meter.done()
        usage["server_cpu_s"] = {r: round(cpu_seconds(p["pid"]) - cpu0[r], 2) for r, p in pins.items()}
    finally:
        if clock is not None:
            clock.close()
        stack.stop()
    return {"phase": mode, "round": round_index, "startup_s": round(startup_s, 1), "pinning": pins,
            "measure": usage, "samples": samples, "burst": burst, "logs": str(log_dir),
            "landings_sharing_a_stamp": clock.shared_stamps if clock is not None else None}
