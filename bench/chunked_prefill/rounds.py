"""The servers of a run, all started at once (an idle server uses no CPU) on the same cores, and the
phases measured against them one at a time, in rounds, the order reversed every other round, so
that outside load drifting over the minutes of a run hits every phase alike."""

from __future__ import annotations

import asyncio
from argparse import Namespace
from collections.abc import Iterator
from pathlib import Path

from bench.chunked_prefill.analysis import BASELINE, load_stats, lone_stats, pool
from bench.chunked_prefill.client import Load, lone_ttft, run_load
from bench.common.children import Server
from bench.common.machine import loadavg
from bench.common.pinning import parse_cores


def measure(servers_plan: dict[str, int | None], phases_plan: dict[str, str], model: Path, texts: Iterator[str],
            per_phase: int, args: Namespace, out: Path) -> dict[str, dict]:
    """Start a server per ``servers_plan`` entry (name -> --max-batched-tokens, None: the default), give
    each a warm-up long prompt, then ``args.rounds`` rounds of: ``--lone-requests`` lone long prompts per
    server, and each phase of ``phases_plan`` (phase -> its server; the baseline has no arrivals).
    Per phase: the pooled figures, each round's, and for the last phase on a server its lone TTFT."""
    model_name = model.resolve().name
    servers: dict[str, Server] = {}
    lone: dict[str, list] = {name: [] for name in servers_plan}
    runs: dict[str, list[dict]] = {phase: [] for phase in phases_plan}
    try:
        for name, budget in servers_plan.items():
            flags = [] if budget is None else ["--max-batched-tokens", str(budget)]
            servers[name] = Server("colocated", model, parse_cores(args.server_cores), args.threads,
                                   out.with_name(f"{out.stem}_{name}.log"), flags + args.server_arg, device=args.device)
        for server in servers.values():
            server.wait(args.startup_timeout)
        print(f"{len(servers)} servers healthy on cores {args.server_cores or 'any'}; load {loadavg()}", flush=True)
        for round_index in range(args.rounds):
            for name, server in servers.items():
                count = args.lone_requests + (1 if round_index == 0 else 0)  # the first one a warm-up
                lone[name] += asyncio.run(lone_ttft(server.url, model_name, [next(texts) for _ in range(count)],
                                                    args.long_max_tokens, args.gap_s, args.request_timeout))
            order = list(phases_plan) if round_index % 2 == 0 else list(reversed(phases_plan))
            for phase in order:
                longs = () if phase == BASELINE else tuple(next(texts) for _ in range(per_phase))
                print(f"--- round {round_index + 1}/{args.rounds}: {phase}", flush=True)
                runs[phase].append(_run(servers[phases_plan[phase]], model_name, longs, args))
    finally:
        for server in servers.values():
            server.stop()
    last = {server: phase for phase, server in phases_plan.items()}  # the phase that reports a server's lone TTFT
    phases = {}
    for phase, server_name in phases_plan.items():
        budget = servers_plan[server_name]
        phases[phase] = {"budget": budget, "server_cmd": servers[server_name].argv,
                         "load": {**load_stats(pool([r["result"] for r in runs[phase]])),
                                  "rounds": [r["conditions"] for r in runs[phase]]}}
        if last[server_name] == phase:
            phases[phase]["lone"] = lone_stats(lone[server_name])
    return phases


def _run(server: Server, model_name: str, longs: tuple[str, ...], args: Namespace) -> dict:
    """One phase once on ``server``: the streams, and the long prompts arriving (none for the baseline)."""
    load = Load(model_name, args.streams, args.stream_tokens, args.duration_s, args.max_requests, longs,
                args.period_s, args.long_max_tokens)
    cpu0, load0 = server.cpu(), loadavg()
    result = asyncio.run(run_load(server.url, load, args.request_timeout))
    conditions = {"wall_s": result["wall_s"], "server_cpu_share": round((server.cpu() - cpu0) / result["wall_s"], 2),
                  "loadavg_1m": [load0, loadavg()]}
    stats = load_stats(result)
    print(f"  {len(result['longs'])} long prompts, {stats['stream_requests']} stream requests: TPOT p50 "
          f"{stats['median_tpot_ms']} ms, p99 {stats['p99_tpot_ms']} ms, ITL p99 {stats['p99_itl_ms']} ms, max "
          f"{stats['max_itl_ms']} ms; server CPU share {conditions['server_cpu_share']}, load "
          f"{conditions['loadavg_1m']}", flush=True)
    return {"result": result, "conditions": conditions}
