"""One soak against a started stack: the ramp, then the hold with the processes sampled, judged
(``analysis``). Returns the report (without the machine, which ``Recorder`` adds)."""

from __future__ import annotations

import argparse
import asyncio
import time

from bench.overload.procs import Sampler
from bench.overload.stack import PdStack
from bench.soak.analysis import Bounds, capacity, growth_table, verdict
from bench.soak.load import hold, ramp


def warmup_of(args: argparse.Namespace) -> float:
    """``--warmup-s``, else 10% of the hold."""
    return args.warmup_s if args.warmup_s is not None else 0.1 * args.duration_s


def run_soak(stack: PdStack, args: argparse.Namespace) -> dict:
    """Ramp (``args.ramp_concurrency``, ``args.ramp_step_s``), then hold ``args.load_fraction`` of the
    capacity for ``args.duration_s`` with a ``Sampler`` every ``args.sample_s``; judged with ``Bounds``
    from ``args.rss_growth_mib``."""
    concurrencies = [int(c) for c in args.ramp_concurrency.split(",") if c.strip()]
    steps = asyncio.run(ramp(stack.url, concurrencies, args.ramp_step_s, args.max_tokens, args.request_timeout))
    cap = capacity(steps)
    target = round(args.load_fraction * cap, 3)
    print(f"ramp {[(s['concurrency'], s['ok_per_s']) for s in steps]}: capacity {cap} req/s; holding {target} req/s "
          f"for {args.duration_s:g} s, sampling every {args.sample_s:g} s", flush=True)
    sampler = Sampler(stack.pids(), args.sample_s)
    t0 = time.monotonic()
    records, skipped = ([], 0) if target <= 0 else asyncio.run(
        hold(stack.url, target, args.duration_s, args.max_in_flight, args.max_tokens, args.request_timeout))
    wall = time.monotonic() - t0
    samples = sampler.stop()
    warmup = warmup_of(args)
    bounds = Bounds(rss_abs_mib=args.rss_growth_mib, fds=args.fd_growth, threads=args.thread_growth)
    table = growth_table(samples, list(stack.pids()), warmup, bounds)
    ok = sum(1 for r in records if r["status"] == 200)
    return {"benchmark": "soak", "ramp": steps, "capacity_per_s": cap, "warmup_s": warmup,
            "hold": {"target_per_s": target, "duration_s": round(wall, 1), "sent": len(records),
                     "skipped": skipped, "achieved_ok_per_s": round(ok / wall, 3) if wall else None},
            "growth": table, "verdict": verdict(records, table, cap), "samples": samples, "records": records}
