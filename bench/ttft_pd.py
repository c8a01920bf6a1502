"""Time to first token of a 1P1D pair (prefill + decode servers, KV moved by mooncake or nixl) vs one
colocated server, at low load: one request at a time.

    python bench/ttft_pd.py                     # full run (~6-8 minutes on 2 cores)
    python bench/ttft_pd.py --quick             # smoke run (~2-3 minutes)
    python bench/ttft_pd.py --backends nixl --requests 12

Workloads (``--workloads``), each one user turn, ``stream=true``, ``max_tokens=8``, ``temperature=0``,
``ignore_eos=true``:

- ``text_short``: a one-line question (~20 prompt tokens with the chat template);
- ``image_64``: one generated 64x64 PNG (``data:`` URL) and a short question;
- ``text_2k``: ~2000 prompt tokens of text (common words, sized with the checkpoint's tokenizer).

TTFT = time from sending the request to the first SSE chunk whose delta carries non-empty content
(the server's first chunk, role only, does not count). For PD the client sends the same body with
``bootstrap_host/port`` and a random 63-bit ``bootstrap_room`` to the prefill and the decode at the
same moment (as a PD router does) and times the decode's stream, which is the reply. Per workload:
one untimed warm-up, then ``--requests`` (6) requests, one at a time with ``--gap-s`` (0.25 s) idle
before each, workloads interleaved; median,
p90 and min; ratio PD / colocated of the medians. Each PD request also records the prefill's KV
write time and bytes (the delta of ``/server_info`` ``transfer`` between requests), and each PD
reply is compared with the colocated reply of the same workload (greedy: identical text expected).

Phases run one after another, never at once: colocated (server on ``--colocated-cores``, core 1),
then per backend a pair (prefill on ``--prefill-cores``, core 0; decode on ``--decode-cores``, core 1);
the whole sequence runs ``--rounds`` times (2; 1 with ``--quick``) and each system's samples are
pooled, so that outside load drifting over the minutes of a run hits every system.
Servers run ``--threads`` torch threads (1). The client is pinned to ``--client-cores`` (default:
not pinned; it shares the cores with the servers). Each phase records the 1-minute load average,
the machine-wide CPU busy fraction and each server's CPU seconds.

Output: a table on stdout, ``bench/results/ttft_pd.json`` and ``ttft_pd.png`` (plus server logs
``ttft_pd_<phase>_r<round>_<role>.log``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(REPO))

from bench.common import (  # noqa: E402
    CpuMeter,
    Server,
    add_model_args,
    add_output_args,
    image_url,
    loadavg,
    machine_info,
    make_image,
    make_parser,
    output_path,
    parse_cores,
    percentile,
    pin_this_process,
    pyplot,
    resolve_model,
    save_figure,
    write_json,
)
from stages.cli import free_port  # noqa: E402

from transfer.registry import BACKENDS  # noqa: E402
WORKLOADS = ("text_short", "image_64", "text_2k")
LONG_TOKENS = 2000  # target prompt length of text_2k


# --- workload --------------------------------------------------------------------------------
def long_text(model_dir: Path, target_tokens: int) -> tuple[str, int]:
    """Common words (the tokenizer's own training vocabulary) sized to ``target_tokens`` prompt tokens
    with the chat template; returns the text and its measured prompt length."""
    from transformers import AutoTokenizer

    from stages.modelgen.corpus import _COMMON

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rng = random.Random(0)

    def prompt_tokens(text: str) -> int:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                            add_generation_prompt=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return len(ids)

    words = [rng.choice(_COMMON) for _ in range(4 * target_tokens)]
    n = target_tokens
    for _ in range(6):  # words are ~1 token each; converge in a few steps
        text = "Summarize this: " + " ".join(words[:n])
        got = prompt_tokens(text)
        if abs(got - target_tokens) <= 8:
            break
        n = max(1, n + (target_tokens - got))
    return text, got


def chat_body(workload: str, long: str, max_tokens: int) -> dict:
    if workload == "text_short":
        content = [{"type": "text", "text": "Hello there! What is the capital of the country with the tallest mountain?"}]
    elif workload == "image_64":
        content = [{"type": "image_url", "image_url": {"url": image_url(make_image(3))}},
                   {"type": "text", "text": "What is in this picture?"}]
    elif workload == "text_2k":
        content = [{"type": "text", "text": long}]
    else:
        raise ValueError(f"unknown workload {workload!r}; choose from {WORKLOADS}")
    return {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}


# --- client ----------------------------------------------------------------------------------
async def stream_reply(client, url: str, body: dict, t0: float) -> dict:
    """POST a streaming chat request; times (from ``t0``) of the role chunk, the first content chunk and the end."""
    first_chunk = first_content = None
    pieces: list[str] = []
    usage = None
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            raise RuntimeError(f"{url}: HTTP {response.status_code}: {response.text[:500]}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.perf_counter() - t0
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"{url}: in-band error {chunk['error']}")
            if first_chunk is None:
                first_chunk = now
            for choice in chunk.get("choices") or []:
                text = (choice.get("delta") or {}).get("content")
                if text:
                    pieces.append(text)
                    if first_content is None:
                        first_content = now
            usage = chunk.get("usage") or usage
    end = time.perf_counter() - t0
    if first_content is None:
        raise RuntimeError(f"{url}: the stream carried no content")
    return {"ttft_s": first_content, "first_chunk_s": first_chunk, "total_s": end, "text": "".join(pieces),
            "prompt_tokens": (usage or {}).get("prompt_tokens"), "completion_tokens": (usage or {}).get("completion_tokens")}


async def transfer_stats(client, url: str) -> dict:
    response = await client.get(f"{url}/server_info")
    return response.json()["transfer"]


async def one_request(client, servers: dict[str, Server], body: dict, bootstrap_port: int | None) -> dict:
    cpu0 = {role: server.cpu() for role, server in servers.items()}
    reply = await _one_request(client, servers, body, bootstrap_port)
    reply["server_cpu_s"] = {role: server.cpu() - cpu0[role] for role, server in servers.items()}
    return reply


async def _one_request(client, servers: dict[str, Server], body: dict, bootstrap_port: int | None) -> dict:
    if "colocated" in servers:
        t0 = time.perf_counter()
        return await stream_reply(client, servers["colocated"].url, body, t0)
    prefill, decode = servers["prefill"], servers["decode"]
    body = {**body, "bootstrap_host": "127.0.0.1", "bootstrap_port": bootstrap_port,
            "bootstrap_room": random.getrandbits(63)}
    before = await transfer_stats(client, prefill.url)

    async def prefill_side(t0: float) -> float:
        response = await client.post(f"{prefill.url}/v1/chat/completions", json=body)
        await response.aread()
        if response.status_code != 200:
            raise RuntimeError(f"prefill: HTTP {response.status_code}: {response.text[:500]}")
        return time.perf_counter() - t0

    t0 = time.perf_counter()
    prefill_done, reply = await asyncio.gather(prefill_side(t0), stream_reply(client, decode.url, body, t0))
    after = await transfer_stats(client, prefill.url)
    reply["prefill_reply_s"] = prefill_done
    reply["kv_write_s"] = after["seconds"] - before["seconds"]
    reply["kv_bytes"] = after["bytes"] - before["bytes"]
    reply["kv_writes"] = after["writes"] - before["writes"]
    return reply


async def measure(servers: dict[str, Server], bodies: dict[str, dict], requests: int, bootstrap_port: int | None,
                  timeout_s: float, gap_s: float) -> dict[str, list[dict]]:
    import httpx

    samples: dict[str, list[dict]] = {w: [] for w in bodies}
    async with httpx.AsyncClient(timeout=timeout_s) as client:
        for workload, body in bodies.items():  # warm-up: one of each, untimed
            samples[workload].append({**await one_request(client, servers, body, bootstrap_port), "warmup": True})
        for _ in range(requests):  # interleaved, one request at a time, an idle gap between them
            for workload, body in bodies.items():
                await asyncio.sleep(gap_s)
                samples[workload].append(await one_request(client, servers, body, bootstrap_port))
    return samples


def summarize(samples: list[dict]) -> dict:
    timed = [s for s in samples if not s.get("warmup")]
    ttft = [s["ttft_s"] for s in timed]
    out = {"n": len(timed), "ttft_ms_median": round(1e3 * statistics.median(ttft), 2),
           "ttft_ms_p90": round(1e3 * percentile(ttft, 0.9), 2), "ttft_ms_min": round(1e3 * min(ttft), 2),
           "first_chunk_ms_median": round(1e3 * statistics.median(s["first_chunk_s"] for s in timed), 2),
           "total_ms_median": round(1e3 * statistics.median(s["total_s"] for s in timed), 2),
           "prompt_tokens": timed[0]["prompt_tokens"], "completion_tokens": timed[0]["completion_tokens"],
           "ttft_ms_all": [round(1e3 * t, 2) for t in ttft], "warmup_ttft_ms": round(1e3 * samples[0]["ttft_s"], 2)}
    # CPU seconds each server spent on the request (its whole duration, /server_info calls included for PD)
    # and the share of its core it got while the request ran (< 1: it waited for the core, or was idle)
    out["server_cpu_s_median"] = {r: round(statistics.median(s["server_cpu_s"][r] for s in timed), 3)
                                  for r in timed[0]["server_cpu_s"]}
    if "kv_write_s" in timed[0]:
        out["kv_write_ms_median"] = round(1e3 * statistics.median(s["kv_write_s"] for s in timed), 3)
        out["kv_bytes"] = timed[0]["kv_bytes"]
        out["kv_gbps_median"] = round(out["kv_bytes"] / (out["kv_write_ms_median"] / 1e3) / 1e9, 3) \
            if out["kv_write_ms_median"] else None
        out["prefill_reply_ms_median"] = round(1e3 * statistics.median(s["prefill_reply_s"] for s in timed), 2)
    return out


def run_phase(name: str, roles: dict[str, list[str]], cores: dict[str, list[int]], args, model: Path,
              bodies: dict[str, dict], out: Path, round_index: int = 1) -> dict:
    """Start the phase's servers, measure, stop them. ``roles``: role -> extra flags."""
    started = time.perf_counter()
    servers = {role: Server(role, model, cores[role], args.threads, out.with_name(f"{out.stem}_{name}_r{round_index}_{role}.log"),
                            flags + args.server_arg) for role, flags in roles.items()}
    bootstrap_port = None
    if "prefill" in roles:
        bootstrap_port = int(roles["prefill"][roles["prefill"].index("--bootstrap-port") + 1])
    try:
        for server in servers.values():
            server.wait(args.startup_timeout)
        startup_s = time.perf_counter() - started
        print(f"[{name}] " + ", ".join(f"{r} pid {s.proc.pid} on cores {s.cores or 'any'}" for r, s in servers.items())
              + f"; healthy after {startup_s:.1f} s; load {loadavg()}", flush=True)
        cpu0 = {r: s.cpu() for r, s in servers.items()}
        meter = CpuMeter({os.getpid(), *(s.proc.pid for s in servers.values())}, cpu_key="client_cpu_s")
        samples = asyncio.run(measure(servers, bodies, args.requests, bootstrap_port, args.request_timeout, args.gap_s))
        usage = meter.done()
        busy = usage["core_busy_fraction"]
        server_cpu = {r: round(s.cpu() - cpu0[r], 2) for r, s in servers.items()}
        # CPU seconds on each pinned core that were not our servers' (other work on the machine)
        foreign = {}
        for role, server in servers.items():
            if len(server.cores) == 1 and busy.get(f"cpu{server.cores[0]}") is not None:
                core = f"cpu{server.cores[0]}"
                foreign[core] = round(foreign.get(core, busy[core] * meter.wall_s) - server_cpu[role], 2)
        phase = {**usage, "server_cpu_s": server_cpu, "other_cpu_s_on_server_cores": foreign,
                 "server_threads_cpu_s": {r: s.threads() for r, s in servers.items()}}
    finally:
        for server in servers.values():
            server.stop()
    result = {"phase": name, "startup_s": round(startup_s, 1), "measure": phase,
              "servers": {r: {"pid": s.proc.pid, "cores": s.cores or None, "cmd": s.cmd, "log": str(s.log_path)}
                          for r, s in servers.items()},
              "workloads": {w: summarize(v) for w, v in samples.items()},
              "samples": samples}
    for w, summary in result["workloads"].items():
        kv = f", KV write {summary['kv_write_ms_median']:.2f} ms ({summary['kv_bytes'] / 2**20:.2f} MiB)" \
            if "kv_write_ms_median" in summary else ""
        print(f"[{name}] {w:<11} {summary['prompt_tokens']:>5} prompt tokens: TTFT median {summary['ttft_ms_median']:.1f} ms"
              f", p90 {summary['ttft_ms_p90']:.1f}, min {summary['ttft_ms_min']:.1f}{kv}", flush=True)
    print(f"[{name}] load {phase['loadavg_1m']}, core busy {phase['core_busy_fraction']}, server CPU s "
          f"{phase['server_cpu_s']}, other CPU s on the server cores {phase['other_cpu_s_on_server_cores']}", flush=True)
    return result


def merge_runs(name: str, runs: list[dict], workloads: list[str]) -> dict:
    """One system's result over all its rounds: samples pooled, each round's conditions kept."""
    pooled = {w: [s for run in runs for s in run["samples"][w]] for w in workloads}
    texts = {w: [s["text"] for s in pooled[w] if not s.get("warmup")] for w in workloads}
    return {"phase": name, "workloads": {w: summarize(pooled[w]) for w in workloads},
            "texts": {w: texts[w][0] for w in workloads},
            "distinct_texts": {w: len(set(texts[w])) for w in workloads},
            "runs": [{k: v for k, v in run.items() if k != "samples"} for run in runs]}


# --- report ----------------------------------------------------------------------------------
def print_table(phases: list[dict], workloads: list[str]) -> None:
    base = next((p for p in phases if p["phase"] == "colocated"), None)
    print()
    header = (f"{'workload':<12}{'prompt':>7}  {'system':<14}{'TTFT p50':>9}{'p90':>9}{'min':>9}{'PD/coloc':>10}"
              f"{'KV write':>10}{'KV MiB':>8}{'KV GB/s':>9}{'same text':>10}")
    print(header)
    print("-" * len(header))
    for w in workloads:
        for i, phase in enumerate(phases):
            s = phase["workloads"][w]
            ratio = f"{s['ttft_ms_median'] / base['workloads'][w]['ttft_ms_median']:.2f}x" if base else "-"
            kv = (f"{s['kv_write_ms_median']:>8.2f}ms{s['kv_bytes'] / 2**20:>8.2f}{s['kv_gbps_median'] or 0:>9.2f}"
                  if "kv_write_ms_median" in s else f"{'':>10}{'':>8}{'':>9}")
            same = "" if phase["phase"] == "colocated" or not base else \
                ("yes" if phase["texts"][w] == base["texts"][w] and phase["distinct_texts"][w] == 1 else "NO")
            lead = f"{w:<12}{s['prompt_tokens'] or 0:>7}" if i == 0 else " " * 19
            print(f"{lead}  {phase['phase']:<14}{s['ttft_ms_median']:>9.1f}{s['ttft_ms_p90']:>9.1f}{s['ttft_ms_min']:>9.1f}"
                  f"{ratio:>10}{kv}{same:>10}")
        print()
    print("TTFT in ms: send -> first SSE chunk with content (decode's stream for PD); PD/coloc = ratio of the medians")


def plot(phases: list[dict], workloads: list[str], path: Path, title: str) -> None:
    """One panel per workload (own y scale): TTFT median per system, bar to p90, KV write hatched, PD/colocated."""
    plt = pyplot()
    base = next((p for p in phases if p["phase"] == "colocated"), None)
    colors = {"colocated": "grey", "pd-mooncake": "tab:blue", "pd-nixl": "tab:orange"}
    fig, axes = plt.subplots(1, len(workloads), figsize=(3.6 * len(workloads), 4.2), squeeze=False)
    for ax, w in zip(axes[0], workloads):
        for i, phase in enumerate(phases):
            s = phase["workloads"][w]
            ax.bar(i, s["ttft_ms_median"], 0.7, yerr=[[0], [s["ttft_ms_p90"] - s["ttft_ms_median"]]], capsize=3,
                   color=colors.get(phase["phase"]))
            if "kv_write_ms_median" in s:
                ax.bar(i, s["kv_write_ms_median"], 0.7, color="black", alpha=0.4, hatch="//")
            label = f"{s['ttft_ms_median']:.0f} ms"
            if base and phase is not base:
                label += f"\n{s['ttft_ms_median'] / base['workloads'][w]['ttft_ms_median']:.2f}x"
            ax.text(i, s["ttft_ms_median"] / 2, label, ha="center", va="center", fontsize=8, color="white")
        ax.set_xticks(range(len(phases)), [p["phase"] for p in phases], fontsize=8)
        ax.set_title(f"{w} ({phases[0]['workloads'][w]['prompt_tokens']} prompt tokens)", fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].set_ylabel("TTFT ms (median, bar to p90; hatched: KV write)")
    fig.suptitle(title, fontsize=9)
    save_figure(fig, path)


# --- main ------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = make_parser(__doc__)
    add_model_args(p)
    p.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated transfer backends ('' : none)")
    p.add_argument("--no-colocated", action="store_true", help="skip the colocated phase")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated workloads")
    p.add_argument("--long-tokens", type=int, default=LONG_TOKENS, help="prompt tokens of text_2k")
    p.add_argument("--requests", type=int, default=6, help="timed requests per workload, phase and round")
    p.add_argument("--rounds", type=int, default=2, help="run the sequence of phases this many times (samples pooled)")
    p.add_argument("--max-tokens", type=int, default=8, help="tokens generated per request")
    p.add_argument("--gap-s", type=float, default=0.25, help="idle time before each request (low load: the servers "
                   "have finished the previous one)")
    p.add_argument("--threads", type=int, default=1, help="torch threads of every server")
    p.add_argument("--colocated-cores", default="1", help="cores of the colocated server ('' : no pinning)")
    p.add_argument("--prefill-cores", default="0", help="cores of the prefill server")
    p.add_argument("--decode-cores", default="1", help="cores of the decode server")
    p.add_argument("--client-cores", default="", help="cores of this process (the client); '' = not pinned")
    p.add_argument("--server-arg", action="append", default=[], help="extra flag for every server (repeat)")
    p.add_argument("--startup-timeout", type=float, default=240.0, help="seconds to wait for /health")
    p.add_argument("--request-timeout", type=float, default=120.0, help="seconds per request")
    add_output_args(p, "ttft_pd", quick_help="smoke run: 3 requests per workload")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.requests, args.rounds = min(args.requests, 3), 1
    workloads = [w for w in args.workloads.split(",") if w.strip()]
    backends = [b for b in args.backends.split(",") if b.strip()]
    cores = {"colocated": parse_cores(args.colocated_cores), "prefill": parse_cores(args.prefill_cores),
             "decode": parse_cores(args.decode_cores)}
    client_cores = pin_this_process(args.client_cores)
    out = output_path(args)
    started = time.time()
    model = resolve_model(args)
    long, long_tokens = long_text(model, args.long_tokens) if "text_2k" in workloads else ("", 0)
    bodies = {w: chat_body(w, long, args.max_tokens) for w in workloads}
    info = machine_info()
    print(f"model {model}; text_2k = {long_tokens} prompt tokens; client pid {os.getpid()} on cores "
          f"{client_cores or 'any'}; load {loadavg()}", flush=True)

    plan: list[tuple[str, dict[str, list[str]] | None]] = [] if args.no_colocated else [("colocated", {"colocated": []})]
    plan += [(f"pd-{backend}", None) for backend in backends]
    runs: dict[str, list[dict]] = {name: [] for name, _ in plan}
    for round_index in range(args.rounds):  # the same sequence again: drifting outside load hits every system
        for name, roles in plan:
            if roles is None:  # a fresh bootstrap port per pair
                backend = name.removeprefix("pd-")
                roles = {"prefill": ["--transfer", backend, "--bootstrap-port", str(free_port())],
                         "decode": ["--transfer", backend]}
            print(f"--- round {round_index + 1}/{args.rounds}: {name}", flush=True)
            runs[name].append({**run_phase(name, roles, cores, args, model, bodies, out, round_index + 1),
                                "round": round_index + 1})
    phases = [merge_runs(name, runs[name], workloads) for name, _ in plan]

    base = next((p for p in phases if p["phase"] == "colocated"), None)
    ratios = {}
    if base:
        for phase in phases:
            if phase is not base:
                ratios[phase["phase"]] = {w: round(phase["workloads"][w]["ttft_ms_median"]
                                                   / base["workloads"][w]["ttft_ms_median"], 3) for w in workloads}
    report = {
        "benchmark": "ttft_pd",
        "machine": info,
        "pinning": {
            "colocated": cores["colocated"] or None, "prefill": cores["prefill"] or None,
            "decode": cores["decode"] or None, "client": {"pid": os.getpid(), "cores": client_cores or None},
            "torch_threads": args.threads,
            "note": "phases ran one after another, never at once; each server's pid is under phases[].runs[].servers",
        },
        "config": {"family": args.family, "size": args.size, "model_dir": str(model), "workloads": workloads,
                   "text_2k_prompt_tokens": long_tokens, "requests": args.requests, "rounds": args.rounds, "gap_s": args.gap_s, "max_tokens": args.max_tokens,
                   "stream": True, "temperature": 0, "ignore_eos": True, "backends": backends, "quick": args.quick,
                   "server_args": args.server_arg,
                   "ttft": "send -> first SSE chunk with non-empty delta content (the decode's stream for PD)"},
        "phases": phases,
        "ratios_pd_vs_colocated": ratios,
        "total_s": round(time.time() - started, 1),
    }
    write_json(out, report)
    png = out.with_suffix(".png")
    plot(phases, workloads, png, f"TTFT, {args.family}-{args.size}, 1 request at a time, {args.threads} torch thread(s); "
                                 f"P core {args.prefill_cores}, D core {args.decode_cores}, colocated core "
                                 f"{args.colocated_cores}")
    print_table(phases, workloads)
    print(f"wrote {out} and {png} ({report['total_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
