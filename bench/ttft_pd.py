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
import math
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(REPO))

from bench.decode_throughput import (
    cpu_seconds,
    image_url,
    loadavg,
    machine_info,
    make_image,
    parse_cores,
)
from stages.cli import ensure_model, free_port, stop_process, wait_healthy

RESULTS = REPO / "bench" / "results"
BACKENDS = ("mooncake", "nixl")
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


# --- servers ---------------------------------------------------------------------------------
class Server:
    def __init__(self, role: str, model: Path, cores: list[int], threads: int, log_path: Path, flags: list[str]) -> None:
        self.role, self.cores, self.port = role, cores, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [sys.executable, "-m", "stages.cli", "serve", role, "--model", str(model), "--port", str(self.port),
                    "--threads", str(threads), "--log-level", "warning", *flags]
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1",
                   PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
        self.log_path = log_path
        with open(log_path, "wb") as log_file:
            self.proc = subprocess.Popen(self.cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        if cores:  # at once: the interpreter is still starting, its threads (torch, transfer) come later and inherit it
            os.sched_setaffinity(self.proc.pid, cores)

    def wait(self, timeout_s: float) -> None:
        try:
            wait_healthy(self.url, self.proc, timeout_s)
        except (RuntimeError, TimeoutError) as exc:
            tail = self.log_path.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{self.role} server: {exc}\n{tail}") from None

    def cpu(self) -> float:
        try:
            return cpu_seconds(self.proc.pid)
        except OSError:
            return float("nan")

    def threads(self, top: int = 8) -> list[list]:
        """The process's busiest threads since it started: [name, CPU seconds], from /proc/PID/task."""
        rows = []
        for task in Path(f"/proc/{self.proc.pid}/task").iterdir():
            try:
                stat = (task / "stat").read_text()
                name = stat[stat.index("(") + 1:stat.rindex(")")]
                fields = stat.rpartition(")")[2].split()
                rows.append([name, round((int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), 2)])
            except (OSError, ValueError):
                continue
        return sorted(rows, key=lambda r: -r[1])[:top]

    def stop(self) -> None:
        stop_process(self.proc)


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


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def summarize(samples: list[dict]) -> dict:
    timed = [s for s in samples if not s.get("warmup")]
    ttft = [s["ttft_s"] for s in timed]
    out = {"n": len(timed), "ttft_ms_median": round(1e3 * statistics.median(ttft), 2),
           "ttft_ms_p90": round(1e3 * pct(ttft, 0.9), 2), "ttft_ms_min": round(1e3 * min(ttft), 2),
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


def busy_fraction(stat0: list[int] | None, stat1: list[int] | None) -> float | None:
    if not stat0 or not stat1:
        return None
    d = [b - a for a, b in zip(stat0, stat1)]
    total = sum(d[:8])
    return round(1 - (d[3] + d[4]) / total, 3) if total else None


def proc_stat() -> dict[str, list[int]]:
    """Jiffies of the machine ("cpu") and of each core ("cpu0", ...)."""
    out = {}
    try:
        for line in Path("/proc/stat").read_text().splitlines():
            if line.startswith("cpu"):
                name, *values = line.split()
                out[name] = [int(x) for x in values]
    except (OSError, ValueError):
        pass
    return out


def process_cpu() -> dict[int, tuple[str, float, int]]:
    """pid -> (command, CPU seconds, last core) of every process on the machine."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            fields = stat.rpartition(")")[2].split()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            name = cmdline[:160] or stat[stat.index("(") + 1:stat.rindex(")")]
            out[int(entry.name)] = (name, (int(fields[11]) + int(fields[12])) / tick, int(fields[36]))
        except (OSError, ValueError, IndexError):
            continue
    return out


def top_processes(before: dict, after: dict, exclude: set[int], top: int = 6) -> list[dict]:
    """The processes (other than ``exclude``) that used the most CPU between two process_cpu() snapshots."""
    rows = []
    for pid, (name, cpu, core) in after.items():
        used = cpu - before.get(pid, (name, 0.0, core))[1]
        if pid not in exclude and used > 0.05:
            rows.append({"pid": pid, "cpu_s": round(used, 2), "last_core": core, "cmd": name})
    return sorted(rows, key=lambda r: -r["cpu_s"])[:top]


def core_busy(stat0: dict, stat1: dict) -> dict[str, float | None]:
    """Busy fraction of the machine and of each core between two proc_stat() snapshots."""
    return {name: busy_fraction(stat0.get(name), stat1.get(name)) for name in stat1}


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
        client_cpu0, stat0, load0, t0 = time.process_time(), proc_stat(), loadavg(), time.perf_counter()
        procs0 = process_cpu()
        samples = asyncio.run(measure(servers, bodies, args.requests, bootstrap_port, args.request_timeout, args.gap_s))
        wall = time.perf_counter() - t0
        busy = core_busy(stat0, proc_stat())
        server_cpu = {r: round(s.cpu() - cpu0[r], 2) for r, s in servers.items()}
        # CPU seconds on each pinned core that were not our servers' (other work on the machine)
        foreign = {}
        for role, server in servers.items():
            if len(server.cores) == 1 and busy.get(f"cpu{server.cores[0]}") is not None:
                core = f"cpu{server.cores[0]}"
                foreign[core] = round(foreign.get(core, busy[core] * wall) - server_cpu[role], 2)
        phase = {"wall_s": round(wall, 2), "loadavg_1m": [load0, loadavg()],
                 "machine_busy_fraction": busy.pop("cpu", None), "core_busy_fraction": busy,
                 "server_cpu_s": server_cpu, "other_cpu_s_on_server_cores": foreign,
                 "client_cpu_s": round(time.process_time() - client_cpu0, 2),
                 "server_threads_cpu_s": {r: s.threads() for r, s in servers.items()},
                 "other_processes": top_processes(procs0, process_cpu(),
                                                  {os.getpid(), *(s.proc.pid for s in servers.values())})}
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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --- main ------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--family", default="qwen2_vl", help="model family (stages.modelgen.FAMILIES)")
    p.add_argument("--size", default="small", help="model size preset")
    p.add_argument("--model-dir", default=None, help="reuse this checkpoint; default: generated into the cache dir")
    p.add_argument("--cache-dir", default=os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")),
                                                       "epd-stage"), help="where generated checkpoints are kept")
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
    p.add_argument("--quick", action="store_true", help="smoke run: 3 requests per workload")
    p.add_argument("--out", default=str(RESULTS / "ttft_pd.json"), help="JSON path (PNG written next to it)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.requests, args.rounds = min(args.requests, 3), 1
    workloads = [w for w in args.workloads.split(",") if w.strip()]
    backends = [b for b in args.backends.split(",") if b.strip()]
    cores = {"colocated": sorted(parse_cores(args.colocated_cores)), "prefill": sorted(parse_cores(args.prefill_cores)),
             "decode": sorted(parse_cores(args.decode_cores))}
    client_cores = sorted(parse_cores(args.client_cores))
    if client_cores:
        os.sched_setaffinity(0, client_cores)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    started = time.time()
    model = Path(args.model_dir) if args.model_dir else ensure_model(
        Path(args.cache_dir) / f"{args.family}-{args.size}", args.family, args.size)
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
    out.write_text(json.dumps(report, indent=2) + "\n")
    png = out.with_suffix(".png")
    plot(phases, workloads, png, f"TTFT, {args.family}-{args.size}, 1 request at a time, {args.threads} torch thread(s); "
                                 f"P core {args.prefill_cores}, D core {args.decode_cores}, colocated core "
                                 f"{args.colocated_cores}")
    print_table(phases, workloads)
    print(f"wrote {out} and {png} ({report['total_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
