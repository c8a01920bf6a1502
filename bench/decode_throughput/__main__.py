"""``python -m bench.decode_throughput``: flags, the server, HF, the levels, the JSON and the summary
(the package's docstring says what is measured)."""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from bench.common.args import (add_cores_args, add_model_args, add_output_args, add_server_args, make_parser,
                               output_path, resolve_model)
from bench.common.children import Server
from bench.common.machine import loadavg
from bench.common.pinning import parse_cores, pin_this_process
from bench.common.record import Recorder
from bench.common.stats import py_spy_summary
from bench.decode_throughput import __doc__ as DOC
from bench.decode_throughput.analysis import TARGET_RATIO, best_level, goal
from bench.decode_throughput.hf import hf_baseline
from bench.decode_throughput.report import figures, plot, print_table
from bench.decode_throughput.server import measure_level, run_level
from bench.decode_throughput.workload import requests_for

PY_SPY_ATTACH_S = 1.0
PY_SPY_STOP_S = 30.0


def build_parser() -> argparse.ArgumentParser:
    p = make_parser(DOC, "bench.decode_throughput")
    add_model_args(p)
    p.add_argument("--concurrency", default="1,8,32", help="comma-separated stream counts")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens generated per request (ignore_eos)")
    p.add_argument("--max-requests", type=int, default=64, help="upper bound on requests per concurrency level")
    p.add_argument("--hf-requests", type=int, default=6, help="requests timed for the HF baseline")
    p.add_argument("--device", default="cpu", help="the server's --device, and where HF generate() runs")
    add_cores_args(p, {"server": ("1", "the server process"), "client": ("0", "this process: the client and HF")})
    add_server_args(p, startup_s=180.0, request_s=300.0, server_env=True)
    p.add_argument("--repeat", type=int, default=2,
                   help="timed runs per level and for HF; the best (highest tokens/s) of each is reported, all are kept")
    p.add_argument("--py-spy", action="store_true", help="record the server with py-spy during the largest level")
    add_output_args(p, "decode_throughput", quick_help="smoke run: 16 tokens, fewer requests")
    return p


def main(argv: list[str] | None = None) -> int:
    args, record = Recorder.start("decode_throughput", build_parser(), argv)
    if args.quick:
        args.max_tokens = min(args.max_tokens, 16)
        args.max_requests = min(args.max_requests, 32)
        args.hf_requests = min(args.hf_requests, 2)
        args.repeat = 1
    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    server_cores = parse_cores(args.server_cores)
    client_cores = pin_this_process(args.client_cores)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    out = output_path(args)
    model = resolve_model(args)
    log_path = out.with_name(out.stem + "_server.log")
    server = Server("colocated", model, server_cores, args.threads, log_path, args.server_arg, args.server_env,
                    device=args.device)
    print(f"server pid {server.proc.pid} on cores {server_cores or 'any'}; client/HF pid {os.getpid()} on cores "
          f"{client_cores or 'any'}; log {log_path}", flush=True)
    py_spy = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))
    if args.py_spy and not py_spy:
        print("--py-spy: py-spy not found (pip install py-spy); not profiling", flush=True)
    try:
        server.wait(args.startup_timeout)
        model_name = model.resolve().name
        print(f"server healthy after {record.elapsed_s():.1f} s; HF baseline ({args.hf_requests} requests, "
              f"server idle) ...", flush=True)
        hf = hf_baseline(model, args.hf_requests, args.max_tokens, args.threads, args.repeat, args.device)
        print(f"HF: {hf['tokens_per_s']:.1f} tok/s ({hf['ms_per_token']:.1f} ms/token incl. prefill), "
              f"CPU share {hf['cpu_share']}, load {loadavg()}", flush=True)
        asyncio.run(run_level(server.url, model_name, 2, 2, args.max_tokens, args.request_timeout))  # warm-up
        results, spy = [], None
        for concurrency in levels:
            runs = []
            for attempt in range(args.repeat):
                profiled = args.py_spy and py_spy and concurrency == max(levels) and attempt == 0
                run, spy = _timed(server, model_name, concurrency, args, out, py_spy if profiled else None, spy)
                runs.append(run)
            level = best_level(runs, hf)
            results.append(level)
            print(f"C={concurrency:>3}: best {level['tokens_per_s']:.1f} tok/s ({level['ratio_vs_hf']:.2f}x HF)", flush=True)
    finally:
        server.stop()

    report = {
        "benchmark": "decode_throughput",
        "pinning": {
            "server": {"pid": server.proc.pid, "cores": server_cores or None, "torch_threads": args.threads},
            "client_and_hf": {"pid": os.getpid(), "cores": client_cores or None, "torch_threads": args.threads},
            "note": "HF generate ran in the client process while the server was idle",
        },
        "config": {
            "family": args.family, "size": args.size, "model_dir": str(model), "max_tokens": args.max_tokens,
            "device": args.device, "image": "64x64 PNG data: URL", "temperature": 0, "ignore_eos": True,
            "stream": False, "levels": levels, "server_env": args.server_env, "max_requests": args.max_requests,
            "hf_requests": args.hf_requests, "repeat": args.repeat,
            "reported": "best of `repeat` runs per side (highest tokens/s); all runs kept",
            "quick": args.quick, "server_cmd": server.argv,
        },
        "hf": hf, "ours": results, "ratios_vs_hf": {str(r["concurrency"]): r["ratio_vs_hf"] for r in results},
        "goal": goal(results), "py_spy": spy,
    }
    png = out.with_suffix(".png")
    plot(hf, results, png, f"{args.family}-{args.size}, {args.max_tokens} tokens/request, "
                           f"{args.threads} torch thread(s), server on core {args.server_cores or 'any'}")
    print_table(hf, results)
    met = report["goal"]
    if met["met"] is None:
        print(f"goal {TARGET_RATIO:.0f}x HF at 32 streams: not measured (32 not in --concurrency)")
    else:
        print(f"goal {TARGET_RATIO:.0f}x HF at 32 streams: {'met' if met['met'] else 'NOT met'} (wall clock), "
              f"{'met' if met['met_cpu_normalized'] else 'NOT met'} (per CPU-second)")
    summary = record.finish(out, report, figures(hf, results))
    print(f"wrote {out}, {png} and {summary} ({record.elapsed_s():.0f} s)")
    return 0


def _timed(server: Server, model_name: str, concurrency: int, args: argparse.Namespace, out: Path,
           py_spy: str | None, profile: dict | None) -> tuple[dict, dict | None]:
    """One timed run at ``concurrency`` (recorded by ``py_spy`` when given); (the run, the profile so far)."""
    n = requests_for(concurrency, args.max_requests)
    spy, raw = None, out.with_name(out.stem + f"_pyspy_c{concurrency}.txt")
    if py_spy:
        spy = subprocess.Popen([py_spy, "record", "--pid", str(server.proc.pid), "--format", "raw", "--rate", "100",
                                "--threads", "--output", str(raw), "--nonblocking"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        time.sleep(PY_SPY_ATTACH_S)
    run = measure_level(server.url, model_name, server.proc.pid, concurrency, n, args)
    run["py_spy"] = spy is not None
    if spy is not None:
        spy.send_signal(signal.SIGINT)
        try:
            spy.wait(PY_SPY_STOP_S)
        except subprocess.TimeoutExpired:
            spy.kill()
        if raw.exists():
            profile = {"concurrency": concurrency, "raw": str(raw), **py_spy_summary(raw)}
    print(f"C={concurrency:>3}: {n} requests, {run['tokens_per_s']:.1f} tok/s, {run['engine_steps']} steps, mean batch "
          f"{run['mean_batch']}, {run['ms_per_step']} ms/step, server CPU share {run['server_cpu_share']}, "
          f"load {run['loadavg_1m']}", flush=True)
    return run, profile


if __name__ == "__main__":
    sys.exit(main())
