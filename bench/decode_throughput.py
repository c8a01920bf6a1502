"""Decode throughput of ``stage serve colocated`` at 1, 8 and 32 concurrent streams, side by side with
Hugging Face ``generate()`` run one request at a time on the same checkpoint and the same torch
thread count.

    python bench/decode_throughput.py                 # full run (a few minutes on 2 cores)
    python bench/decode_throughput.py --quick         # smoke run (~1-2 minutes)
    python bench/decode_throughput.py --family llava --model-dir /path/to/ckpt --max-tokens 128

Workload: every request is a short image+text chat (a generated 64x64 PNG as a ``data:`` URL plus
one of a few short questions), ``temperature=0``, ``max_tokens`` tokens with ``ignore_eos=true``
(our request extension), so every request produces exactly ``max_tokens`` tokens. For each
concurrency C the client sends N requests (N = clamp(2C, 8, --max-requests)), at most C in flight,
non-streaming, and measures wall time from the first send to the last response;
tokens/s = completion tokens / wall time (so prefill and HTTP time are included, as a client sees them).

The HF baseline builds the same prompt (our ``PromptBuilder``: chat template, image processor,
placeholder expansion, identical to the HF processor token for token), then calls
``model.generate(max_new_tokens=T, min_new_tokens=T, do_sample=False)`` one request at a time;
tokens/s = generated tokens / time (prefill included likewise).

CPU pinning (2 cores): the server process gets ``--server-cores`` (default core 1), this process
(the HTTP client and the HF baseline) ``--client-cores`` (default core 0); both use ``--threads``
torch threads (default 1). HF runs while the server is idle (after /health, before any request).

Devices: ``--device`` (default ``cpu``) is the server's ``--device`` and where HF runs too, so a GPU
run compares both on the same GPU (``--device cuda --server-cores '' --client-cores ''``; the CPU
figures in the table then measure the host side only). scripts/gpu-check.sh runs it that way.

Output: a table on stdout, ``bench/results/decode_throughput.json`` (machine, config, per-concurrency
results, ratios vs HF) and ``decode_throughput.png`` next to it. ``--py-spy`` additionally records
the server with py-spy during the largest concurrency (raw collapsed stacks + a summary in the JSON).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(REPO))

from bench.common import (  # noqa: E402  (no torch import)
    Server,
    add_model_args,
    add_output_args,
    cpu_seconds,
    image_url,
    loadavg,
    machine_info,
    make_image,
    make_parser,
    output_path,
    parse_cores,
    pin_this_process,
    pyplot,
    resolve_model,
    save_figure,
    write_json,
)

QUESTIONS = (
    "What is in this picture?",
    "Describe the image in one sentence.",
    "Which colours do you see here?",
    "Is there a shape in this image? Name it.",
    "Write a short caption for this picture.",
    "What stands out in this image?",
    "Count the objects you can see.",
    "Where is the bright part of the picture?",
)
TARGET_RATIO = 8.0  # the issue's goal at 32 streams


# --- workload --------------------------------------------------------------------------------
def workload(index: int):
    """(PIL image, question) of request ``index``; the same list drives the server and the HF baseline."""
    return make_image(index % 16), QUESTIONS[index % len(QUESTIONS)]


def requests_for(concurrency: int, max_requests: int) -> int:
    return max(8, min(2 * concurrency, max_requests), concurrency)


# --- server metrics --------------------------------------------------------------------------
def scrape_metrics(base: str) -> dict[str, float]:
    """The server's Prometheus counters we use: steps and requests per step (batch-size histogram)."""
    import urllib.request

    with urllib.request.urlopen(f"{base}/metrics", timeout=10) as response:
        text = response.read().decode()
    values = {}
    for name in ("epd_batch_size_count", "epd_batch_size_sum", "epd_generation_tokens_total",
                 "epd_time_per_output_token_seconds_sum", "epd_time_per_output_token_seconds_count"):
        match = re.search(rf"^{name}\s+(\S+)$", text, re.M)
        if match:
            values[name] = float(match.group(1))
    return values


# --- HF baseline -----------------------------------------------------------------------------
def hf_baseline(model_dir: Path, n_requests: int, max_tokens: int, threads: int, repeat: int = 1,
                device: str = "cpu") -> dict:
    import torch

    from stages.engine.config import resolve_device
    from stages.engine.models import load_adapter
    from stages.prompt import PromptBuilder

    target = resolve_device(device)
    if target.type == "cpu":
        torch.set_num_threads(threads)
    t0 = time.perf_counter()
    # load_adapter = AutoModelForImageTextToText.from_pretrained(dir, dtype=float32, attn_implementation="sdpa");
    # with "sdpa" the model is plain HF, and the adapter gives PromptBuilder its image-token rule.
    adapter = load_adapter(model_dir, torch.float32, "sdpa", device=target)
    model = adapter.model
    builder = PromptBuilder.load(model_dir, adapter)
    load_s = time.perf_counter() - t0

    def inputs_for(index: int) -> dict:
        image, question = workload(index)
        prompt = builder.build([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}],
                               [image])
        ids = torch.tensor([prompt.token_ids], device=target)
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        if prompt.images[0].grid_thw is not None:  # Qwen family
            inputs["pixel_values"] = torch.cat([im.pixel_values for im in prompt.images]).to(target)
            inputs["image_grid_thw"] = torch.tensor([im.grid_thw for im in prompt.images], device=target)
            inputs["mm_token_type_ids"] = (ids == adapter.image_token_id).int()
        else:
            inputs["pixel_values"] = torch.stack([im.pixel_values for im in prompt.images]).to(target)
        return inputs

    def synchronize() -> None:
        if target.type == "cuda":
            torch.cuda.synchronize(target)

    def run(index: int) -> tuple[int, float, int]:
        inputs = inputs_for(index)
        synchronize()
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(**inputs, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False)
        synchronize()
        elapsed = time.perf_counter() - start
        return out.shape[1] - inputs["input_ids"].shape[1], elapsed, inputs["input_ids"].shape[1]

    run(0)  # warm-up
    runs = []
    for _ in range(repeat):
        tokens = seconds = 0.0
        cpu0 = time.process_time()
        per_request = []
        for index in range(n_requests):
            generated, elapsed, prompt_len = run(index)
            tokens += generated
            seconds += elapsed
            per_request.append({"prompt_tokens": prompt_len, "completion_tokens": generated,
                                "seconds": round(elapsed, 4)})
        cpu = time.process_time() - cpu0
        runs.append({
            "requests": n_requests,
            "completion_tokens": int(tokens),
            "seconds": round(seconds, 3),
            "tokens_per_s": round(tokens / seconds, 2),
            "ms_per_token": round(1000 * seconds / tokens, 2),
            "cpu_s": round(cpu, 2),
            "cpu_share": round(cpu / seconds, 2),  # < 1: this process waited for its core (other load)
            "tokens_per_cpu_s": round(tokens / cpu, 1),
            "loadavg_1m": loadavg(),
            "per_request": per_request,
        })
    model = adapter = None  # free the weights (cleared rather than del: the closures above use the names)
    best = dict(max(runs, key=lambda r: r["tokens_per_s"]))
    best["tokens_per_cpu_s"] = max(r["tokens_per_cpu_s"] for r in runs)
    best.update(load_s=round(load_s, 2), runs=[{k: v for k, v in r.items() if k != "per_request"} for r in runs])
    return best


# --- our server ------------------------------------------------------------------------------
async def run_level(base: str, model_name: str, concurrency: int, n_requests: int, max_tokens: int,
                    timeout_s: float) -> dict:
    from openai import AsyncOpenAI

    urls = {i: image_url(workload(i)[0]) for i in range(16)}
    client = AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=timeout_s)
    semaphore = asyncio.Semaphore(concurrency)
    latencies: list[float] = []

    async def one(index: int) -> tuple[int, int, str]:
        _, question = workload(index)
        async with semaphore:
            start = time.perf_counter()
            reply = await client.chat.completions.create(
                model=model_name,
                messages=[{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": urls[index % 16]}},
                    {"type": "text", "text": question}]}],
                max_tokens=max_tokens, temperature=0, stream=False, extra_body={"ignore_eos": True})
            latencies.append(time.perf_counter() - start)
        return reply.usage.completion_tokens, reply.usage.prompt_tokens, reply.choices[0].finish_reason

    try:
        start = time.perf_counter()
        results = await asyncio.gather(*(one(i) for i in range(n_requests)))
        wall = time.perf_counter() - start
    finally:
        await client.close()
    completion = sum(r[0] for r in results)
    short = [r for r in results if r[0] != max_tokens]
    latencies.sort()
    return {
        "concurrency": concurrency,
        "requests": n_requests,
        "completion_tokens": completion,
        "prompt_tokens_mean": round(sum(r[1] for r in results) / len(results), 1),
        "requests_short_of_max_tokens": len(short),
        "finish_reasons": dict(Counter(r[2] for r in results)),
        "wall_s": round(wall, 3),
        "tokens_per_s": round(completion / wall, 2),
        "latency_s_p50": round(latencies[len(latencies) // 2], 3),
        "latency_s_max": round(latencies[-1], 3),
    }


def py_spy_summary(raw_path: Path, top: int = 25) -> dict:
    """Self time and inclusive time by function from py-spy's raw (collapsed) output."""
    own: Counter = Counter()
    inclusive: Counter = Counter()
    threads: Counter = Counter()
    total = 0
    for line in raw_path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = stack.split(";")
        threads[frames[0]] += n
        own[frames[-1]] += n
        for frame in set(frames[1:]):
            inclusive[frame] += n
    def pct(counter):
        return [[name, round(100 * n / total, 1)] for name, n in counter.most_common(top)]
    return {"samples": total, "threads_pct": pct(threads), "self_pct": pct(own), "inclusive_pct": pct(inclusive)}


def measure_level(base: str, model_name: str, pid: int, concurrency: int, n: int, args) -> dict:
    """One timed run at ``concurrency``, with the server's steps (from /metrics) and CPU time (from /proc)."""
    before = scrape_metrics(base)
    cpu_before, load_before = cpu_seconds(pid), loadavg()
    run = asyncio.run(run_level(base, model_name, concurrency, n, args.max_tokens, args.request_timeout))
    server_cpu = cpu_seconds(pid) - cpu_before
    after = scrape_metrics(base)
    steps = after.get("epd_batch_size_count", 0) - before.get("epd_batch_size_count", 0)
    batched = after.get("epd_batch_size_sum", 0) - before.get("epd_batch_size_sum", 0)
    run.update(
        server_cpu_s=round(server_cpu, 2),
        server_cpu_share=round(server_cpu / run["wall_s"], 2),  # < 1: idle gaps or other load on its core
        tokens_per_server_cpu_s=round(run["completion_tokens"] / server_cpu, 1) if server_cpu else None,
        loadavg_1m=[load_before, loadavg()],
        engine_steps=int(steps),
        mean_batch=round(batched / steps, 2) if steps else None,
        ms_per_step=round(1000 * run["wall_s"] / steps, 2) if steps else None,
    )
    return run


# --- report ----------------------------------------------------------------------------------
def print_table(hf: dict, levels: list[dict]) -> None:
    """Wall-clock tokens/s (the measure) plus the CPU share each side got and tokens per CPU-second
    (a cross-check on a shared machine: the server's CPU time includes its HTTP threads)."""
    print()
    print(f"{'system':<28}{'streams':>8}{'reqs':>6}{'tokens':>8}{'wall s':>8}{'tok/s':>8}{'vs HF':>8}"
          f"{'cpu share':>10}{'tok/cpu-s':>10}{'vs HF':>8}")
    print("-" * 96)
    print(f"{'HF generate (1 at a time)':<28}{1:>8}{hf['requests']:>6}{hf['completion_tokens']:>8}"
          f"{hf['seconds']:>8.2f}{hf['tokens_per_s']:>8.1f}{1.0:>7.2f}x{hf['cpu_share']:>10.2f}"
          f"{hf['tokens_per_cpu_s']:>10.1f}{1.0:>7.2f}x")
    for level in levels:
        print(f"{'stage serve colocated':<28}{level['concurrency']:>8}{level['requests']:>6}"
              f"{level['completion_tokens']:>8}{level['wall_s']:>8.2f}{level['tokens_per_s']:>8.1f}"
              f"{level['ratio_vs_hf']:>7.2f}x{level['server_cpu_share']:>10.2f}"
              f"{level.get('tokens_per_server_cpu_s') or 0:>10.1f}{level.get('cpu_normalized_ratio_vs_hf') or 0:>7.2f}x")
    print()


def plot(hf: dict, levels: list[dict], path: Path, title: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs = [level["concurrency"] for level in levels]
    ys = [level["tokens_per_s"] for level in levels]
    ax.plot(xs, ys, "o-", label="stage serve colocated")
    for x, y, level in zip(xs, ys, levels):
        ax.annotate(f"{y:.0f} ({level['ratio_vs_hf']:.1f}x)", (x, y), textcoords="offset points", xytext=(4, 6),
                    fontsize=8)
    ax.axhline(hf["tokens_per_s"], color="grey", linestyle="--", label=f"HF generate, 1 at a time ({hf['tokens_per_s']:.0f})")
    ax.axhline(TARGET_RATIO * hf["tokens_per_s"], color="tab:red", linestyle=":", label=f"goal: {TARGET_RATIO:.0f}x HF")
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("output tokens / s")
    ax.set_ylim(bottom=0)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    save_figure(fig, path)


# --- main ------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = make_parser(__doc__)
    add_model_args(p)
    p.add_argument("--concurrency", default="1,8,32", help="comma-separated stream counts")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens generated per request (ignore_eos)")
    p.add_argument("--max-requests", type=int, default=64, help="upper bound on requests per concurrency level")
    p.add_argument("--hf-requests", type=int, default=6, help="requests timed for the HF baseline")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the server and of HF (CPU only)")
    p.add_argument("--device", default="cpu", help="the server's --device, and where HF generate() runs")
    p.add_argument("--server-cores", default="1", help="CPU cores the server process is pinned to ('' : no pinning)")
    p.add_argument("--client-cores", default="0", help="CPU cores of this process: client and HF ('' : no pinning)")
    p.add_argument("--server-arg", action="append", default=[], help="extra flag for `stage serve colocated` (repeat)")
    p.add_argument("--server-env", action="append", default=[],
                   help="KEY=VALUE for the server's environment (repeat); PYTHONPATH=DIR is prepended")
    p.add_argument("--startup-timeout", type=float, default=180.0, help="seconds to wait for /health")
    p.add_argument("--request-timeout", type=float, default=300.0, help="seconds per request")
    p.add_argument("--repeat", type=int, default=2,
                   help="timed runs per level and for HF; the best (highest tokens/s) of each is reported, all are kept")
    p.add_argument("--py-spy", action="store_true", help="record the server with py-spy during the largest level")
    add_output_args(p, "decode_throughput", quick_help="smoke run: 16 tokens, fewer requests")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.max_tokens = min(args.max_tokens, 16)
        args.max_requests = min(args.max_requests, 32)
        args.hf_requests = min(args.hf_requests, 2)
        args.repeat = 1
    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    server_cores = parse_cores(args.server_cores)
    cpus_available = sorted(os.sched_getaffinity(0))  # before this process pins itself
    client_cores = pin_this_process(args.client_cores)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    out = output_path(args)

    model = resolve_model(args)
    started = time.time()
    log_path = out.with_name(out.stem + "_server.log")
    server = Server("colocated", model, server_cores, args.threads, log_path, args.server_arg, args.server_env,
                    device=args.device)
    proc, base = server.proc, server.url
    print(f"server pid {proc.pid} on cores {server_cores or 'any'}; client/HF pid {os.getpid()} on cores "
          f"{client_cores or 'any'}; log {log_path}", flush=True)
    results: list[dict] = []
    profile = None
    py_spy = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))
    if args.py_spy and not py_spy:
        print("--py-spy: py-spy not found (pip install py-spy); not profiling", flush=True)
    try:
        # this process's own imports (torch, transformers) overlap with the server's model load on another core
        info = machine_info()
        info["cpus_available"] = cpus_available
        server.wait(args.startup_timeout)
        model_name = model.resolve().name
        print(f"server healthy after {time.time() - started:.1f} s; HF baseline ({args.hf_requests} requests, "
              f"server idle) ...", flush=True)
        hf = hf_baseline(model, args.hf_requests, args.max_tokens, args.threads, args.repeat, args.device)
        print(f"HF: {hf['tokens_per_s']:.1f} tok/s ({hf['ms_per_token']:.1f} ms/token incl. prefill), "
              f"CPU share {hf['cpu_share']}, load {loadavg()}", flush=True)

        asyncio.run(run_level(base, model_name, 2, 2, args.max_tokens, args.request_timeout))  # warm-up
        for concurrency in levels:
            n = requests_for(concurrency, args.max_requests)
            runs = []
            for attempt in range(args.repeat):
                spy = None
                if args.py_spy and concurrency == max(levels) and attempt == 0 and py_spy:
                    raw = out.with_name(out.stem + f"_pyspy_c{concurrency}.txt")
                    spy = (subprocess.Popen([py_spy, "record", "--pid", str(proc.pid), "--format", "raw", "--rate",
                                             "100", "--threads", "--output", str(raw), "--nonblocking"],
                                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE), raw)
                    time.sleep(1.0)  # let py-spy attach
                run = measure_level(base, model_name, proc.pid, concurrency, n, args)
                run["py_spy"] = spy is not None
                if spy is not None:
                    spy[0].send_signal(signal.SIGINT)
                    try:
                        spy[0].wait(30)
                    except subprocess.TimeoutExpired:
                        spy[0].kill()
                    if spy[1].exists():
                        profile = {"concurrency": concurrency, "raw": str(spy[1]), **py_spy_summary(spy[1])}
                runs.append(run)
                print(f"C={concurrency:>3} run {attempt + 1}/{args.repeat}: {n} requests, {run['tokens_per_s']:.1f} tok/s, "
                      f"{run['engine_steps']} steps, mean batch {run['mean_batch']}, {run['ms_per_step']} ms/step, "
                      f"server CPU share {run['server_cpu_share']}, load {run['loadavg_1m']}", flush=True)
            level = dict(max(runs, key=lambda r: r["tokens_per_s"]))
            level["tokens_per_server_cpu_s"] = max((r["tokens_per_server_cpu_s"] or 0) for r in runs) or None
            level["ratio_vs_hf"] = round(level["tokens_per_s"] / hf["tokens_per_s"], 2)
            if level["tokens_per_server_cpu_s"]:
                level["cpu_normalized_ratio_vs_hf"] = round(level["tokens_per_server_cpu_s"] / hf["tokens_per_cpu_s"], 2)
            level["runs"] = runs
            results.append(level)
            print(f"C={concurrency:>3}: best {level['tokens_per_s']:.1f} tok/s ({level['ratio_vs_hf']:.2f}x HF)", flush=True)
    finally:
        server.stop()

    at_goal = [r for r in results if r["concurrency"] == 32]
    report = {
        "benchmark": "decode_throughput",
        "machine": info,
        "pinning": {
            "server": {"pid": proc.pid, "cores": server_cores or None, "torch_threads": args.threads},
            "client_and_hf": {"pid": os.getpid(), "cores": client_cores or None, "torch_threads": args.threads},
            "note": "HF generate ran in the client process while the server was idle",
        },
        "config": {
            "family": args.family, "size": args.size, "model_dir": str(model), "max_tokens": args.max_tokens,
            "device": args.device,
            "image": "64x64 PNG data: URL", "temperature": 0, "ignore_eos": True, "stream": False,
            "levels": levels, "server_env": args.server_env, "max_requests": args.max_requests, "hf_requests": args.hf_requests,
            "repeat": args.repeat, "reported": "best of `repeat` runs per side (highest tokens/s); all runs kept",
            "quick": args.quick, "server_cmd": server.cmd,
        },
        "hf": hf,
        "ours": results,
        "ratios_vs_hf": {str(r["concurrency"]): r["ratio_vs_hf"] for r in results},
        "goal": {"ratio": TARGET_RATIO, "at_streams": 32,
                 "met": bool(at_goal[0]["ratio_vs_hf"] >= TARGET_RATIO) if at_goal else None,
                 "met_cpu_normalized": bool((at_goal[0].get("cpu_normalized_ratio_vs_hf") or 0) >= TARGET_RATIO)
                 if at_goal else None},
        "py_spy": profile,
        "total_s": round(time.time() - started, 1),
    }
    write_json(out, report)
    png = out.with_suffix(".png")
    plot(hf, results, png, f"{args.family}-{args.size}, {args.max_tokens} tokens/request, "
                           f"{args.threads} torch thread(s), server on core {args.server_cores or 'any'}")
    print_table(hf, results)
    goal = report["goal"]
    if goal["met"] is None:
        print(f"goal {TARGET_RATIO:.0f}x HF at 32 streams: not measured (32 not in --concurrency)")
    else:
        print(f"goal {TARGET_RATIO:.0f}x HF at 32 streams: {'met' if goal['met'] else 'NOT met'} (wall clock), "
              f"{'met' if goal['met_cpu_normalized'] else 'NOT met'} (per CPU-second)")
    print(f"wrote {out} and {png} ({report['total_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
