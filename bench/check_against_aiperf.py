"""Check ``stage bench serve`` against NVIDIA aiperf: the same requests, the same load, the same server;
their TTFT and throughput should agree within 10%.

    .venv/bin/python -m bench.check_against_aiperf                 # ~2 minutes: 2 rounds, 64 requests per tool at 1.5/s
    .venv/bin/python -m bench.check_against_aiperf --quick         # ~1 minute: 1 round, 24 requests
    .venv/bin/python -m bench.check_against_aiperf --closed-loop --concurrency 8 --output-len 64 --images-per-request 1
    .venv/bin/python -m bench.check_against_aiperf --server paced --out bench/results/check_against_aiperf_paced.json

aiperf is not a project dependency; it lives in its own venv (about 1.2 GB, no torch)::

    python -m venv bench/.venv-tools && bench/.venv-tools/bin/pip install aiperf==0.13.0

What runs: one ``stage serve colocated`` (``--family qwen2_vl --size small`` unless ``--model-dir``) pinned
to ``--server-cores`` (1) with 1 torch thread; this script and both clients (and every process aiperf
spawns) on ``--client-cores`` (0). The requests are the seeded synthetic mix of ``stage bench serve``,
written twice: as our JSONL workload and as aiperf's ``single_turn`` file, with the same text, the same
``data:`` PNGs, the text before the images in both, and the same ``max_tokens`` (aiperf sends it with
``--use-legacy-max-tokens``); both send ``ignore_eos`` and ``temperature 0`` and stream with usage. Load:
``--request-rate`` (1.5) requests/s per tool, evenly spaced (ours ``--burstiness inf``, aiperf
``--arrival-pattern constant``), no cap in flight; or with ``--closed-loop`` ``--concurrency`` (4) requests
in flight per tool (ours ``--max-concurrency``, aiperf ``--concurrency``). ``--requests`` in all, after
``--warmup`` untimed requests. The default is the open loop because aiperf 0.13's concurrency mode spins
its timing manager (``try_issue_credit`` retried after a bare yield while no slot is free): a whole core
for the run, which on two shared cores slows the server under test and aiperf's own reads; its rate mode
sleeps between sends (5-6 CPU s per 48-request run, ours 1.1-1.3).

``--mode side-by-side`` (default): in each round aiperf starts, and when its profiling phase starts
``stage bench serve`` starts; both then drive the same server at once, so outside load on this shared
machine hits both alike. They do not start and end at the same instant (ours needs ~1 s to start, and a
client that keeps up worse finishes later), so each tool's first and last requests share the server less.
``--mode sequential``: one tool after the other, the order alternating by round: the same load in the
strict sense, but on a busy machine the two runs see different outside load, and aiperf's own CPU use
(~10x ours) moves other processes onto the server's core (the server's share of its core is recorded).

``--server paced`` replaces the model server with ``bench/paced_server.py`` (first token ``--paced-ttft-ms``
after the body arrives, then one every ``--paced-itl-ms``; no model, ~1% of a core): the truth is known,
so the table also shows what a perfect client would measure, and each tool's own overhead is visible.

Compared (ours / aiperf, means over rounds): TTFT mean and median (aiperf ``time_to_first_token``), TPOT
mean (aiperf ``inter_token_latency``, which is per-request (latency - TTFT) / (tokens - 1), vllm's TPOT),
E2E mean (``request_latency``), request throughput and output token throughput. Prompt and output token
totals must be equal (both from the server's usage).

Output: a table, ``bench/results/check_against_aiperf.json`` (machine, config, each round's numbers from
both tools, ratios, ``agree_within_10pct``), each tool's own files under ``bench/results/check_against_aiperf/``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench.common.args import (REPO, add_cores_args, add_model_args, add_output_args, add_server_args, make_parser,
                               output_path, resolve_model)
from bench.common.children import Child, Server
from bench.common.machine import loadavg
from bench.common.pinning import parse_cores, pin_this_process
from bench.common.record import Figure, Recorder
from bench.serve.config import Mix, parse_size, parse_weighted
from bench.serve.workload import Request, image_urls, prompt_text, summarize, synthesize, write_jsonl
from process.ports import free_port

AIPERF = REPO / "bench" / ".venv-tools" / "bin" / "aiperf"
AIPERF_PROFILING_STARTED = "Phase profiling (profiling) started"  # aiperf 0.13's log line
TOLERANCE = 0.10
COMPARED = ("ttft_mean_ms", "ttft_median_ms", "request_throughput", "output_throughput")  # the 10% goal
ALSO_SHOWN = ("tpot_mean_ms", "e2el_mean_ms", "total_input_tokens", "total_output_tokens")


# --- the workload, written for both tools ------------------------------------------------------
def workload_files(args, folder: Path) -> tuple[Path, Path, dict]:
    """Our JSONL and aiperf's single_turn JSONL of the same ``--requests`` requests (text first, then the
    images). Each tool's warm-up sends the first ``--warmup`` of them, untimed, then all of them timed
    (aiperf, sampling sequentially, may start the timed pass where its warm-up stopped and wrap: the same
    set in a rotated order)."""
    mix = Mix(num_requests=args.requests, seed=args.seed, input_len=args.input_len,
              output_len=args.output_len, repeat_image_share=args.repeat_image_share,
              images_per_request=parse_weighted("--images-per-request", args.images_per_request, int),
              image_sizes=parse_weighted("--image-sizes", args.image_sizes, parse_size))
    requests = synthesize(mix)
    ours, theirs = folder / "workload_ours.jsonl", folder / "workload_aiperf.jsonl"
    text_first = [Request([{"role": "user", "content": [{"type": "text", "text": prompt_text(r)},
                                                        *({"type": "image_url", "image_url": {"url": url}}
                                                          for url in image_urls(r))]}], r.max_tokens)
                  for r in requests]
    write_jsonl(ours, text_first)
    with open(theirs, "w") as out:
        for r in requests:
            row = {"text": prompt_text(r), "output_length": r.max_tokens}
            if image_urls(r):
                row["images"] = image_urls(r)
            out.write(json.dumps(row) + "\n")
    return ours, theirs, summarize(text_first)


# --- the server -------------------------------------------------------------------------------
def paced_server(model_name: str, cores: list[int], ttft_ms: float, itl_ms: float, log_path: Path) -> Child:
    """``bench/paced_server.py`` on a free loopback port, pinned to ``cores``: known TTFT and ITL, no model."""
    port = free_port()
    return Child("paced server", [sys.executable, str(REPO / "bench" / "paced_server.py"), "--port", str(port),
                                  "--model", model_name, "--ttft-ms", str(ttft_ms), "--itl-ms", str(itl_ms)],
                 cores, log_path, url=f"http://127.0.0.1:{port}")


def expected(args, workload: dict) -> dict | None:
    """What a perfect client measures against the paced server (None for the real one): TTFT and TPOT
    as set, E2E = TTFT + (mean tokens - 1) * ITL, throughput = concurrency / E2E."""
    if args.server != "paced":
        return None
    e2el = args.paced_ttft_ms + (workload["mean_max_tokens"] - 1) * args.paced_itl_ms
    per_s = (args.requests / ((args.requests - 1) / args.request_rate + e2el / 1e3) if args.request_rate else
             args.concurrency / e2el * 1e3)  # rate: the last request is sent at (N - 1) / rate and takes e2el
    return {"ttft_mean_ms": args.paced_ttft_ms, "ttft_median_ms": args.paced_ttft_ms, "tpot_mean_ms": args.paced_itl_ms,
            "e2el_mean_ms": e2el, "request_throughput": per_s, "output_throughput": per_s * workload["mean_max_tokens"]}


# --- the two clients ---------------------------------------------------------------------------
class Run:
    """One client run as a child process, its output in ``folder/stdout.txt``. ``started`` is set once it
    prints a line containing ``ready_marker`` (None: at once). ``finish()`` waits for it (``os.wait4``: the
    CPU seconds of the tool and of every process it spawned and waited for) and returns its numbers."""

    def __init__(self, cmd: list[str], folder: Path, parse, timeout_s: float,
                 ready_marker: str | None = None) -> None:
        self.folder, self.parse, self.timeout_s, self.t0 = folder, parse, timeout_s, time.perf_counter()
        self.started = threading.Event()
        if ready_marker is None:
            self.started.set()
        self.proc = subprocess.Popen(cmd, cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.reader = threading.Thread(target=self._read, args=(ready_marker,), daemon=True)
        self.reader.start()

    def _read(self, marker: str | None) -> None:
        with open(self.folder / "stdout.txt", "w") as log:
            for line in self.proc.stdout:
                log.write(line)
                if marker is not None and marker in line:
                    self.started.set()
        self.started.set()  # it ended without the marker: finish() says how

    def finish(self) -> dict:
        """Wait (at most the run timeout, then kill), check the exit code, parse the tool's files."""
        deadline = self.t0 + self.timeout_s
        try:
            _, status, usage = _wait4(self.proc.pid, deadline)
        except TimeoutError:
            self.proc.kill()
            _, status, usage = os.wait4(self.proc.pid, 0)
        self.proc.returncode = os.waitstatus_to_exitcode(status)
        self.reader.join(10)
        if self.proc.returncode != 0:
            tail = (self.folder / "stdout.txt").read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{self.proc.args[0]} exited {self.proc.returncode}:\n{tail}")
        return {**self.parse(self.folder), "tool_cpu_s": round(usage.ru_utime + usage.ru_stime, 2),
                "wall_s": round(time.perf_counter() - self.t0, 1)}


def _wait4(pid: int, deadline: float):
    """``os.wait4`` of a child, polled until ``deadline`` (then TimeoutError)."""
    while time.perf_counter() < deadline:
        waited, status, usage = os.wait4(pid, os.WNOHANG)
        if waited:
            return waited, status, usage
        time.sleep(0.1)
    raise TimeoutError


def start_ours(args, url: str, workload: Path, folder: Path) -> Run:
    """``stage bench serve`` on the workload: its first ``--warmup`` requests untimed, then all of them."""
    load = (["--request-rate", str(args.request_rate), "--burstiness", "inf"] if args.request_rate else
            ["--max-concurrency", str(args.concurrency)])
    cmd = [sys.executable, "-m", "cli", "bench", "serve", "--url", url, "--workload", str(workload), *load,
           "--warmup", str(args.warmup), "--no-progress", "--out", str(folder),
           "--request-timeout-s", str(args.request_timeout)]
    return Run(cmd, folder, parse_ours, args.run_timeout)


def parse_ours(folder: Path) -> dict:
    r = json.loads((folder / "result.json").read_text())
    return {"ttft_mean_ms": r["mean_ttft_ms"], "ttft_median_ms": r["median_ttft_ms"], "ttft_p99_ms": r["p99_ttft_ms"],
            "tpot_mean_ms": r["mean_tpot_ms"], "e2el_mean_ms": r["mean_e2el_ms"],
            "request_throughput": r["request_throughput"], "output_throughput": r["output_throughput"],
            "total_input_tokens": r["total_input_tokens"], "total_output_tokens": r["total_output_tokens"],
            "completed": r["completed"], "failed": r["failed"], "duration_s": r["duration"]}


def start_aiperf(args, url: str, model: Path, workload: Path, folder: Path) -> Run:
    """aiperf on the same requests, sampled in order, its first ``--warmup`` as its warm-up phase;
    ``started`` is set when its profiling phase starts."""
    load = (["--request-rate", str(args.request_rate), "--arrival-pattern", "constant"] if args.request_rate else
            ["--concurrency", str(args.concurrency)])
    cmd = [str(args.aiperf), "profile", "--model", model.name, "--url", url, "--endpoint-type", "chat", "--streaming",
           "--input-file", str(workload), "--custom-dataset-type", "single_turn",
           "--dataset-sampling-strategy", "sequential", *load, "--request-count", str(args.requests), "--warmup-request-count", str(args.warmup),
           "--use-legacy-max-tokens", "--extra-inputs", "ignore_eos:true", "--extra-inputs", "temperature:0",
           "--use-server-token-count", "--tokenizer", str(model), "--output-artifact-dir", str(folder),
           "--request-timeout-seconds", str(args.request_timeout), "--no-server-metrics", "--no-gpu-telemetry",
           "--ui-type", "none"]
    return Run(cmd, folder, parse_aiperf, args.run_timeout, ready_marker=AIPERF_PROFILING_STARTED)


def parse_aiperf(folder: Path) -> dict:
    d = json.loads((folder / "profile_export_aiperf.json").read_text())
    return {"ttft_mean_ms": d["time_to_first_token"]["avg"], "ttft_median_ms": d["time_to_first_token"]["p50"],
            "ttft_p99_ms": d["time_to_first_token"]["p99"], "tpot_mean_ms": d["inter_token_latency"]["avg"],
            "e2el_mean_ms": d["request_latency"]["avg"], "request_throughput": d["request_throughput"]["avg"],
            "output_throughput": d["output_token_throughput"]["avg"],
            "total_input_tokens": d["total_usage_prompt_tokens"]["avg"],
            "total_output_tokens": d["total_usage_completion_tokens"]["avg"],
            "completed": d["request_count"]["avg"], "failed": sum(e.get("count", 0) for e in d["error_summary"]),
            "duration_s": d["benchmark_duration"]["avg"]}


def run_round(args, index: int, server: Child, model: Path, files: tuple[Path, Path],
              folder: Path) -> dict:
    """One round. ``sequential``: one tool after the other, the order alternating by round. ``side-by-side``:
    aiperf starts; when its profiling phase starts, ours starts; both run at once on the same server, each
    with ``--concurrency`` requests in flight. Also: the share of a core the server got meanwhile."""
    dirs = {tool: folder / f"r{index + 1}_{tool}" for tool in ("ours", "aiperf")}
    for path in dirs.values():
        path.mkdir(exist_ok=True)
    start = {"ours": lambda: start_ours(args, server.url, files[0], dirs["ours"]),
             "aiperf": lambda: start_aiperf(args, server.url, model, files[1], dirs["aiperf"])}
    result: dict = {"round": index + 1, "loadavg_1m": loadavg()}
    cpu0, t0 = server.cpu(), time.perf_counter()
    if args.mode == "side-by-side":
        theirs = start["aiperf"]()
        theirs.started.wait(args.run_timeout)
        mine = start["ours"]()
        result["ours"], result["aiperf"] = mine.finish(), theirs.finish()
    else:
        result["order"] = ["ours", "aiperf"] if index % 2 == 0 else ["aiperf", "ours"]
        for tool in result["order"]:
            result[tool] = start[tool]().finish()
    result["server_cpu_share"] = round((server.cpu() - cpu0) / (time.perf_counter() - t0), 3)
    return result


# --- comparison --------------------------------------------------------------------------------
def compare(rounds: list[dict], truth: dict | None) -> dict:
    """Per metric: each tool's mean over rounds, the ratio ours / aiperf, whether it is within 10%, and
    against the paced server what a perfect client would measure."""
    out = {}
    for key in (*COMPARED, "ttft_p99_ms", *ALSO_SHOWN):
        ours = sum(r["ours"][key] for r in rounds) / len(rounds)
        theirs = sum(r["aiperf"][key] for r in rounds) / len(rounds)
        ratio = ours / theirs if theirs else None
        out[key] = {"ours": round(ours, 3), "aiperf": round(theirs, 3), "ratio": round(ratio, 4) if ratio else None,
                    "within_10pct": ratio is not None and abs(ratio - 1) <= TOLERANCE}
        if truth and key in truth:
            out[key]["expected"] = round(truth[key], 3)
    return out


def figures(comparison: dict) -> list[Figure]:
    """Ours / aiperf of each compared measure, and each tool's TTFT mean and requests/s (with the truth
    against the paced server)."""
    out = [Figure(f"{key}: ours / aiperf", comparison[key]["ratio"], "x") for key in COMPARED]
    for key, unit in (("ttft_mean_ms", "ms"), ("request_throughput", "req/s")):
        row = comparison[key]
        out += [Figure(f"{key}, ours", row["ours"], unit), Figure(f"{key}, aiperf", row["aiperf"], unit)]
        if "expected" in row:
            out.append(Figure(f"{key}, expected (paced server)", row["expected"], unit))
    return out


def print_table(comparison: dict) -> None:
    print(f"\n{'metric':<22}{'stage bench':>13}{'aiperf':>13}{'expected':>10}{'ratio':>9}  within 10%")
    for key, row in comparison.items():
        mark = ("yes" if row["within_10pct"] else "NO") if key in COMPARED else "(shown)"
        truth = f"{row['expected']:>10.2f}" if "expected" in row else f"{'':>10}"
        print(f"{key:<22}{row['ours']:>13.2f}{row['aiperf']:>13.2f}{truth}{row['ratio'] or 0:>9.3f}  {mark}")


# --- main --------------------------------------------------------------------------------------
def build_parser():
    p = make_parser(__doc__, "bench.check_against_aiperf")
    add_model_args(p)
    p.add_argument("--requests", type=int, default=64, help="timed requests per client run")
    p.add_argument("--warmup", type=int, default=4, help="untimed requests before each run")
    p.add_argument("--request-rate", type=float, default=1.5, help="requests/s per tool, evenly spaced (ours "
                   "--burstiness inf, aiperf --arrival-pattern constant), no cap in flight")
    p.add_argument("--closed-loop", action="store_true", help="instead of --request-rate: --concurrency requests in "
                   "flight per tool (aiperf's timing manager then spins a core)")
    p.add_argument("--concurrency", type=int, default=4, help="with --closed-loop: requests in flight per tool")
    p.add_argument("--rounds", type=int, default=2, help="rounds of (ours, aiperf)")
    p.add_argument("--mode", choices=["side-by-side", "sequential"], default="side-by-side",
                   help="both tools at once on the server (robust to outside load), or one after the other")
    p.add_argument("--images-per-request", default="0:0.5,1:0.5", help="as stage bench serve")
    p.add_argument("--image-sizes", default="224x224:1", help="as stage bench serve")
    p.add_argument("--repeat-image-share", type=float, default=0.0, help="as stage bench serve")
    p.add_argument("--input-len", type=int, default=32, help="prompt words per request")
    p.add_argument("--output-len", type=int, default=32, help="max_tokens per request")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic mix")
    p.add_argument("--server", choices=["colocated", "paced"], default="colocated",
                   help="stage serve colocated on the model, or bench/paced_server.py (known TTFT and ITL, no model)")
    p.add_argument("--paced-ttft-ms", type=float, default=100.0, help="--server paced: first token after this")
    p.add_argument("--paced-itl-ms", type=float, default=20.0, help="--server paced: a token every this")
    add_cores_args(p, {"server": ("1", "the server"), "client": ("0", "this script and both clients")})
    p.add_argument("--aiperf", default=str(AIPERF), help="the aiperf executable")
    p.add_argument("--run-timeout", type=float, default=900.0, help="seconds per client run")
    add_server_args(p, startup_s=240.0, request_s=300.0)
    add_output_args(p, "check_against_aiperf", quick_help="1 round of 24 requests")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not Path(args.aiperf).exists():
        print(f"no aiperf at {args.aiperf}; install it in its own venv:\n"
              "    python -m venv bench/.venv-tools && bench/.venv-tools/bin/pip install aiperf==0.13.0", file=sys.stderr)
        return 2
    record = Recorder.of_script("check_against_aiperf", parser, args, argv)
    if args.closed_loop:
        args.request_rate = None
    if args.quick:
        args.requests, args.rounds = min(args.requests, 24), 1
    out = output_path(args).resolve()  # the clients run in their own folders
    folder = out.with_suffix("")
    folder.mkdir(parents=True, exist_ok=True)
    client_cores = pin_this_process(args.client_cores)  # the clients are children: they inherit it
    model = resolve_model(args)
    ours_file, aiperf_file, workload = workload_files(args, folder)
    cores = parse_cores(args.server_cores)
    server = (Server("colocated", model, cores, args.threads, folder / "server.log", args.server_arg)
              if args.server == "colocated" else paced_server(model.name, cores, args.paced_ttft_ms, args.paced_itl_ms, folder / "server.log"))
    rounds = []
    try:
        server.wait(args.startup_timeout)
        print(f"server {server.url} (pid {server.proc.pid}, cores {server.cores or 'any'}); clients on cores "
              f"{client_cores or 'any'}; load {loadavg()}", flush=True)
        for index in range(args.rounds):
            result = run_round(args, index, server, model, (ours_file, aiperf_file), folder)
            for tool in ("ours", "aiperf"):
                r = result[tool]
                print(f"round {index + 1} {tool:<6}: TTFT mean {r['ttft_mean_ms']:.1f} ms, {r['request_throughput']:.2f} "
                      f"req/s, {r['output_throughput']:.1f} tok/s over {r['duration_s']:.1f} s; the tool used "
                      f"{r['tool_cpu_s']:.1f} CPU s", flush=True)
            print(f"round {index + 1}: the server had {result['server_cpu_share']:.0%} of a core; load "
                  f"{result['loadavg_1m']}", flush=True)
            rounds.append(result)
    finally:
        server.stop()
    comparison = compare(rounds, expected(args, workload))
    report = {
        "benchmark": "check_against_aiperf",
        "pinning": {"server": server.cores or None, "clients": client_cores or None, "torch_threads": args.threads},
        "config": {"mode": args.mode, "server": args.server,
                   "paced": {"ttft_ms": args.paced_ttft_ms, "itl_ms": args.paced_itl_ms} if args.server == "paced" else None,
                   "model_dir": str(model), "requests": args.requests, "warmup": args.warmup,
                   "concurrency": None if args.request_rate else args.concurrency, "request_rate": args.request_rate,
                   "rounds": args.rounds, "images_per_request": args.images_per_request,
                   "image_sizes": args.image_sizes, "input_len": args.input_len, "output_len": args.output_len,
                   "seed": args.seed, "aiperf": args.aiperf, "workload": workload},
        "rounds": rounds, "comparison": comparison,
        "agree_within_10pct": all(comparison[key]["within_10pct"] for key in COMPARED),
    }
    print_table(comparison)
    summary = record.finish(out, report, figures(comparison))
    print(f"agree within 10%: {report['agree_within_10pct']}; wrote {out} and {summary}")
    return 0 if report["agree_within_10pct"] else 1


if __name__ == "__main__":
    sys.exit(main())
