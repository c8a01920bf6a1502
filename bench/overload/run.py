"""One overload run against a started stack: sample the processes, fire the burst, check recovery,
judge (``analysis``). Returns the report (without the machine, which ``Recorder`` adds)."""

from __future__ import annotations

import argparse
import asyncio
import time

from bench.overload.analysis import rss_growth, summarize_outcomes, verdict
from bench.overload.burst import burst, recovered
from bench.overload.procs import Sampler
from bench.overload.stack import PdStack

SETTLE_SAMPLES = 2  # samples after the burst before the sampler stops


def run_overload(stack: PdStack, args: argparse.Namespace) -> dict:
    """The burst of ``args.clients`` x ``args.requests_per_client`` requests against ``stack``,
    sampled every ``args.sample_s``, judged against ``args.max_rss_growth_mib``."""
    sampler = Sampler(stack.pids(), args.sample_s)
    print(f"burst: {args.clients} clients x {args.requests_per_client} requests, deadline {args.deadline_s:g} s",
          flush=True)
    start = time.monotonic()
    records, finished = asyncio.run(burst(stack.url, args.clients, args.requests_per_client, args.max_tokens,
                                          args.request_timeout, args.deadline_s))
    end = time.monotonic()
    health = recovered({name: child.url for name, child in stack.children.items()}, stack.url, args.max_tokens)
    time.sleep(args.sample_s * SETTLE_SAMPLES)  # a pause to sample in, not a synchronization
    samples = sampler.stop()
    outcomes = summarize_outcomes(records)
    growth = rss_growth(samples, list(stack.pids()))
    expected = args.clients * args.requests_per_client
    return {"benchmark": "overload", "outcomes": outcomes, "rss": growth, "recovered": health,
            "verdict": verdict(outcomes, growth, args.max_rss_growth_mib, expected, finished, health),
            "burst_wall_s": round(end - start, 2),
            "burst_window_s": [round(start - sampler.t0, 2), round(end - sampler.t0, 2)],
            "samples": samples, "records": records}
