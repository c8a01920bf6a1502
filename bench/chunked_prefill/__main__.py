"""``python -m bench.chunked_prefill``: flags, the engine's step costs, the servers and their phases,
the JSON and the summary (the package's docstring says what is measured)."""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

from bench.chunked_prefill import __doc__ as DOC
from bench.chunked_prefill.analysis import BASELINE, CHUNKED, goal, problems, ratios, replay_ratios
from bench.chunked_prefill.cost import chunk_costs
from bench.chunked_prefill.replay import replay_phases
from bench.chunked_prefill.report import figures, plot, print_tables
from bench.chunked_prefill.rounds import measure
from bench.chunked_prefill.workload import long_texts
from bench.common.args import (add_cores_args, add_model_args, add_output_args, add_server_args, make_parser,
                               output_path, resolve_model)
from bench.common.machine import loadavg
from bench.common.pinning import parse_cores, pin_this_process
from bench.common.record import Recorder

UNCHUNKED = 65536  # --max-batched-tokens of the unchunked server: any long prompt here is one step
ARRIVAL_SLACK = 8  # long prompts prepared per phase beyond duration / period (the streams' last requests)


def build_parser() -> argparse.ArgumentParser:
    p = make_parser(DOC, "bench.chunked_prefill")
    add_model_args(p)
    p.add_argument("--streams", type=int, default=8, help="running streams (closed loop)")
    p.add_argument("--stream-tokens", type=int, default=64, help="tokens per stream request (ignore_eos)")
    p.add_argument("--duration-s", type=float, default=20.0, help="seconds each stream keeps starting requests, "
                   "per phase and round")
    p.add_argument("--max-requests", type=int, default=500, help="upper bound on requests per stream and phase")
    p.add_argument("--long-tokens", type=int, default=2000, help="prompt tokens of an arriving long prompt")
    p.add_argument("--long-max-tokens", type=int, default=8, help="tokens each long prompt generates")
    p.add_argument("--period-s", type=float, default=2.0, help="a long prompt arrives every this many seconds")
    p.add_argument("--unchunked", type=int, default=UNCHUNKED, help="--max-batched-tokens of the unchunked server")
    p.add_argument("--sweep", default="",
                   help="more servers with arrivals, one per --max-batched-tokens value (e.g. 128,256,512)")
    p.add_argument("--cost-budgets", default="64,128,256,512,1024,2048",
                   help="budgets whose step costs are measured in the engine alone ('' : none)")
    p.add_argument("--replay-s", type=float, default=20.0,
                   help="seconds of engine CPU time each phase is replayed on the engine alone (0: no replay)")
    p.add_argument("--lone-requests", type=int, default=2, help="timed lone long prompts per server and round "
                   "(after one warm-up)")
    p.add_argument("--rounds", type=int, default=2, help="every phase this many times, the order reversed every other "
                   "round (samples pooled)")
    p.add_argument("--gap-s", type=float, default=0.25, help="idle time before each lone long prompt")
    p.add_argument("--device", default="cpu", help="the servers' --device, and the engine's for the step costs")
    add_cores_args(p, {"server": ("1", "each server, and the engine-alone step costs"), "client": ("0", "this process")})
    add_server_args(p, startup_s=180.0, request_s=300.0)
    add_output_args(p, "chunked_prefill", quick_help="smoke run: 12 s phases, 1 round, 2 step-cost budgets, 6 s replays")
    return p


def main(argv: list[str] | None = None) -> int:
    args, record = Recorder.start("chunked_prefill", build_parser(), argv)
    if args.quick:
        args.duration_s, args.rounds, args.replay_s = min(args.duration_s, 12.0), 1, min(args.replay_s, 6.0)
        args.cost_budgets = ",".join(b for b in args.cost_budgets.split(",") if b.strip() in ("256", "2048")) or "256"
    server_cores = parse_cores(args.server_cores)
    client_cores = pin_this_process(args.client_cores)
    out = output_path(args)
    model = resolve_model(args)
    default = default_budget(args.device)
    sweep = [int(b) for b in args.sweep.split(",") if b.strip()]
    servers_plan: dict[str, int | None] = {CHUNKED: None, "unchunked": args.unchunked, **{f"budget={b}": b for b in sweep}}
    phases_plan = {BASELINE: CHUNKED, **{name: name for name in servers_plan}}  # phase -> its server
    per_phase = math.ceil(args.duration_s / args.period_s) + ARRIVAL_SLACK
    needed = len(servers_plan) * (1 + args.rounds * args.lone_requests) + args.rounds * len(servers_plan) * per_phase
    all_texts, long_tokens = long_texts(model, args.long_tokens, 1 + needed)  # each its own word order
    print(f"model {model}; long prompt {long_tokens} tokens; default --max-batched-tokens {default}; client pid "
          f"{os.getpid()} on cores {client_cores or 'any'}; load {loadavg()}", flush=True)

    costs = []
    if args.cost_budgets.strip():
        os.sched_setaffinity(0, server_cores or os.sched_getaffinity(0))  # the engine where the servers run
        costs = chunk_costs(model, [int(b) for b in args.cost_budgets.split(",") if b.strip()], all_texts[0], args.streams,
                            args.threads, args.device)
    replayed: dict[str, dict] = {}
    if args.replay_s > 0:
        os.sched_setaffinity(0, server_cores or os.sched_getaffinity(0))
        replay_texts = all_texts[1:1 + math.ceil(args.replay_s / args.period_s) + 2]
        replayed = replay_phases(model, {BASELINE: None, **servers_plan}, replay_texts, args.streams, args.stream_tokens,
                                 args.replay_s, args.period_s, args.long_max_tokens, args.threads, args.device)
        for phase in replayed.values():
            phase["budget"] = phase["budget"] or default
    if client_cores:
        os.sched_setaffinity(0, client_cores)
    phases = measure(servers_plan, phases_plan, model, iter(all_texts[1:]), per_phase, args, out)
    for phase in phases.values():
        phase["budget"] = phase["budget"] or default
    by_phase = ratios(phases)
    wrong = problems(phases)
    report: dict = {
        "benchmark": "chunked_prefill",
        "pinning": {"server": server_cores or None, "client": {"pid": os.getpid(), "cores": client_cores or None},
                    "torch_threads": args.threads, "note": "the servers ran at once on the same cores, measured one at a "
                    "time; the engine-alone step costs ran in this process on the server cores before any server"},
        "config": {"family": args.family, "size": args.size, "model_dir": str(model), "device": args.device,
                   "streams": args.streams, "stream_tokens": args.stream_tokens, "duration_s": args.duration_s,
                   "long_prompt_tokens": long_tokens, "long_max_tokens": args.long_max_tokens,
                   "period_s": args.period_s, "default_max_batched_tokens": default, "unchunked": args.unchunked,
                   "sweep": args.sweep, "lone_requests": args.lone_requests, "rounds": args.rounds, "quick": args.quick,
                   "server_args": args.server_arg, "stream": True, "temperature": 0, "ignore_eos": True,
                   "tpot": "per request (e2el - ttft) / (output tokens - 1), rounds pooled",
                   "itl": "every gap between token chunks of those requests, pooled"},
        "engine_step_costs": costs, "phases": phases, "ratios_vs_alone": by_phase, "goal": goal(by_phase),
        "replay": {"phases": replayed, "ratios_vs_alone": replay_ratios(replayed) if replayed else {},
                   "clock": "the engine thread's CPU seconds", "duration_s": args.replay_s},
        "problems": wrong,
    }
    png = out.with_suffix(".png")
    plot(phases, by_phase, costs, report["replay"]["ratios_vs_alone"], png, f"{args.family}-{args.size}, {args.streams} streams x {args.stream_tokens} tokens, "
         f"a {long_tokens}-token prompt every {args.period_s:g} s; {args.threads} torch thread(s), server core "
         f"{args.server_cores or 'any'}")
    print_tables(phases, by_phase, costs, args.period_s, replayed, report["replay"]["ratios_vs_alone"])
    met = report["goal"]
    print(f"goal: TPOT p99 {CHUNKED} (budget {default}) <= {met['ratio']:g}x {BASELINE}: {met['value']}x, "
          f"{'met' if met['met'] else 'NOT met'}")
    for line in wrong:
        print(f"problem: {line}")
    summary = record.finish(out, report, None if wrong else figures(phases, by_phase, costs, report["replay"]["ratios_vs_alone"]))
    print(f"wrote {out}, {png} and {summary or 'no summary (problems above)'} ({record.elapsed_s():.0f} s)")
    return 1 if wrong else 0


def default_budget(device: str) -> int:
    """The servers' --max-batched-tokens when the flag is not given."""
    from stages.engine.config import EngineConfig

    return EngineConfig(model="-", device=device).batched_tokens


if __name__ == "__main__":
    sys.exit(main())
