"""Router overhead in PD mode (text only): our router, sglang-router and vllm-router in front of the same
fake prefill + decode pair, against the client driving the pair itself, in one run.

    .venv/bin/python bench/router_overhead.py              # full run, ~3-4 minutes (+ the peers' install once)
    .venv/bin/python bench/router_overhead.py --quick      # smoke run, ~1 minute
    .venv/bin/python bench/router_overhead.py --py-spy     # also profile our router at concurrency 32

Backends: ``bench/fake_backend.py`` (one process, a prefill port and a decode port, no model), so a
router's cost is not buried under model time: a JSON answer comes back at once, a stream paces its
tokens ``--itl-ms`` apart. Measured per target (``direct`` = the client sends the body with
``bootstrap_host/port/room`` to the prefill and the decode at once and takes the decode's answer,
as a PD router does):
- c=1, non-stream: latency p50/p99; added = router - direct;
- c=1, stream: time to the first body byte and to the first token (first non-empty ``delta.content``);
- c=32, non-stream: throughput (requests/s) and latency p50/p99;
- CPU per request of the router process (and its children): utime+stime from ``/proc`` over each phase.
Phases run one target at a time; the sequence of targets runs ``--rounds`` times (order reversed
every other round) and samples are pooled, so drifting outside load hits every target.

Peers are installed from PyPI into their own venv (``--peers-venv``), never the project's:
``sglang-router==0.3.2`` (``python -m sglang_router.launch_router --pd-disaggregation``, bootstrap
fields like ours, prefill and decode at once) and ``vllm-router==0.1.17`` (``--vllm-pd-disaggregation``:
the prefill first with ``max_tokens=1`` and ``kv_transfer_params``, then the decode, so its added
latency includes one extra sequential round trip by design). A peer that fails to install or start
is recorded under ``skipped`` and the run goes on. Every router uses round-robin for both roles.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(REPO))

from bench.common import (  # noqa: E402  (no torch import)
    CpuMeter,
    add_output_args,
    free_port,
    loadavg,
    machine_info,
    make_parser,
    output_path,
    parse_cores,
    percentile,
    pin_this_process,
    pyplot,
    save_figure,
    stop_process,
    thread_cpu,
    write_json,
)
from bench.decode_throughput import py_spy_summary  # noqa: E402

PEERS = {"sglang-router": "sglang-router==0.3.2", "vllm-router": "vllm-router==0.1.17"}
TOKENS = 8
JSON_HEADERS = {"Content-Type": "application/json"}
STARTUP_S = 60.0


# --- processes -------------------------------------------------------------------------------
@dataclass
class Proc:
    """A child process pinned to ``cores`` (before exec: every thread it makes inherits them)."""

    name: str
    argv: list[str]
    cores: list[int]
    log_path: Path
    url: str = ""
    proc: subprocess.Popen = field(init=False)

    def __post_init__(self) -> None:
        cores = self.cores
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                                         preexec_fn=(lambda: os.sched_setaffinity(0, cores)) if cores else None)

    def wait(self, path: str, timeout_s: float = STARTUP_S) -> None:
        """Until GET url+path answers 200; RuntimeError with the log's end if it exits or times out."""
        import urllib.error
        import urllib.request

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                with urllib.request.urlopen(self.url + path, timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.2)
        state = f"exited with code {self.proc.returncode}" if self.proc.poll() is not None else "not ready"
        raise RuntimeError(f"{self.name} {state} within {timeout_s:g} s; log:\n"
                           f"{self.log_path.read_text(errors='replace')[-2000:]}")

    def cpu_s(self) -> float:
        """utime + stime of the process and its descendants."""
        return sum(_cpu(pid) for pid in _tree(self.proc.pid))

    def stop(self) -> None:
        stop_process(self.proc, 10)


def _cpu(pid: int) -> float:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = stat.rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _tree(root: int) -> list[int]:
    """``root`` and every live descendant (from /proc/*/stat parent pids)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int(entry.joinpath("stat").read_text().rpartition(")")[2].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            parents.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += parents.get(pid, [])
    return out


def ensure_peers(venv: Path) -> tuple[dict[str, str], dict[str, str]]:
    """Install the peer routers (and py-spy) into ``venv`` once. Returns (versions by peer, install
    errors by peer)."""
    pip = venv / "bin" / "pip"
    if not pip.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    versions, errors = {}, {}
    for name, spec in [*PEERS.items(), ("py-spy", "py-spy==0.4.3")]:
        shown = subprocess.run([str(pip), "show", name], capture_output=True, text=True)
        if shown.returncode != 0:
            print(f"installing {spec} into {venv}", flush=True)
            done = subprocess.run([str(pip), "install", "-q", spec], capture_output=True, text=True)
            if done.returncode != 0:
                errors[name] = done.stderr.strip()[-1000:]
                continue
            shown = subprocess.run([str(pip), "show", name], capture_output=True, text=True)
        versions[name] = next((line.split()[-1] for line in shown.stdout.splitlines() if line.startswith("Version")),
                              "?")
    return versions, errors


def router_argv(name: str, venv: Path, port: int, prefill: str, decode: str, bootstrap: int) -> list[str]:
    bin_ = venv / "bin"
    if name == "ours":
        return [sys.executable, "-m", "stages.cli", "serve", "router", "--host", "127.0.0.1", "--port", str(port),
                "--prefill", prefill, "--decode", decode, "--policy-prefill", "round_robin",
                "--policy-decode", "round_robin", "--log-level", "warning"]
    metrics = ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
    if name == "sglang-router":
        return [str(bin_ / "python"), "-m", "sglang_router.launch_router", "--pd-disaggregation",
                "--prefill", prefill, str(bootstrap), "--decode", decode, "--host", "127.0.0.1", "--port", str(port),
                "--policy", "round_robin", "--log-level", "warn", *metrics]
    return [str(bin_ / "vllm-router"), "--vllm-pd-disaggregation", "--prefill", prefill, "--decode", decode,
            "--host", "127.0.0.1", "--port", str(port), "--policy", "round_robin", "--log-level", "error", *metrics]


# --- client ----------------------------------------------------------------------------------
def chat_body(stream: bool) -> dict:
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "Hello! How far is the moon?"}],
            "max_tokens": TOKENS, "temperature": 0}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    return body


@dataclass
class Sample:
    latency_s: float
    first_byte_s: float | None = None
    first_token_s: float | None = None


class Client:
    """Sends one target's requests over kept-alive connections and checks every answer's text."""

    def __init__(self, target: str, url: str, pd: tuple[str, str, int] | None) -> None:
        self.target, self.url, self.pd = target, url, pd  # pd: (prefill url, decode url, bootstrap port): direct
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                             timeout=aiohttp.ClientTimeout(total=30))
        self.errors: list[str] = []

    async def close(self) -> None:
        await self.session.close()

    async def one(self, stream: bool) -> Sample | None:
        body = chat_body(stream)
        if self.pd is None:
            return await self._call(self.url, body, stream)
        prefill, decode, bootstrap = self.pd
        body |= {"bootstrap_host": "127.0.0.1", "bootstrap_port": bootstrap, "bootstrap_room": random.getrandbits(63)}
        side = asyncio.ensure_future(self._call(prefill, {**body, "stream": False}, False, expect="a"))
        answer = await self._call(decode, body, stream)
        await side
        return answer

    async def _call(self, url: str, body: dict, stream: bool, expect: str = "a" * TOKENS) -> Sample | None:
        payload = json.dumps(body).encode()
        t0 = time.perf_counter()
        try:
            async with self.session.post(url + "/v1/chat/completions", data=payload, headers=JSON_HEADERS) as r:
                if not stream:
                    raw = await r.read()
                    end = time.perf_counter()
                    text = json.loads(raw)["choices"][0]["message"]["content"] if r.status == 200 else raw.decode()
                    return self._check(r.status, text, expect, Sample(end - t0))
                first_byte = first_token = None
                buffer, text = b"", ""
                async for data in r.content.iter_any():
                    now = time.perf_counter()
                    first_byte = first_byte or now
                    buffer += data
                    *events, buffer = buffer.split(b"\n\n")
                    for event in events:
                        if not event.startswith(b"data: ") or event == b"data: [DONE]":
                            continue
                        choices = json.loads(event[6:]).get("choices") or [{}]
                        content = (choices[0].get("delta") or {}).get("content")
                        if content:
                            first_token = first_token or now
                            text += content
                end = time.perf_counter()
                sample = Sample(end - t0, (first_byte or end) - t0, (first_token or end) - t0)
                return self._check(r.status, text, expect, sample)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError) as exc:
            self.errors.append(f"{type(exc).__name__}: {exc}")
            return None

    def _check(self, status: int, text: str, expect: str, sample: Sample) -> Sample | None:
        if status == 200 and text == expect:
            return sample
        self.errors.append(f"HTTP {status}: {text[:200]!r}")
        return None


async def run_level(client: Client, concurrency: int, n: int, stream: bool) -> tuple[list[Sample], float]:
    """``n`` requests with at most ``concurrency`` in flight; (samples, wall seconds)."""
    left = n
    samples: list[Sample] = []

    async def worker() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            sample = await client.one(stream)
            if sample is not None:
                samples.append(sample)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return samples, time.perf_counter() - t0


async def stats_of(session: aiohttp.ClientSession, url: str) -> dict:
    async with session.get(url + "/bench/stats") as r:
        return await r.json()


async def measure(client: Client, router: Proc | None, backend_url: str, args) -> dict:
    """One round of one target: warm-up, then the three phases; samples and CPU per phase."""
    await run_level(client, 4, args.warmup, False)
    await run_level(client, 1, max(args.warmup // 4, 5), True)
    out: dict = {}
    for phase, concurrency, n, stream in (("c1", 1, args.requests_c1, False), ("stream", 1, args.requests_stream, True),
                                          ("c32", args.concurrency, args.requests_c32, False)):
        before = await stats_of(client.session, backend_url)
        cpu0 = router.cpu_s() if router else None
        errors0 = len(client.errors)
        samples, wall = await run_level(client, concurrency, n, stream)
        cpu = router.cpu_s() - cpu0 if router else None
        after = await stats_of(client.session, backend_url)
        reached = {k: after.get(k, 0) - before.get(k, 0) for k in ("prefill_requests", "decode_requests")}
        out[phase] = {"samples": samples, "wall_s": wall, "router_cpu_s": cpu, "errors": client.errors[errors0:],
                      "reached": reached, "sent": n}
    return out


# --- statistics and report -------------------------------------------------------------------
def summarize(target: str, rounds: list[dict]) -> dict:
    """Pool the rounds of one target into the reported numbers (ms, µs, requests/s)."""
    out: dict = {"target": target}
    for phase in ("c1", "stream", "c32"):
        samples = [s for r in rounds for s in r[phase]["samples"]]
        wall = sum(r[phase]["wall_s"] for r in rounds)
        cpu = [r[phase]["router_cpu_s"] for r in rounds]
        lat = [1000 * s.latency_s for s in samples]
        row = {"requests": len(samples), "errors": sum(len(r[phase]["errors"]) for r in rounds),
               "first_errors": [e for r in rounds for e in r[phase]["errors"]][:3],
               "latency_ms_p50": round(percentile(lat, 0.5), 3), "latency_ms_p99": round(percentile(lat, 0.99), 3),
               "latency_ms_mean": round(sum(lat) / len(lat), 3), "wall_s": round(wall, 2),
               "requests_per_s": round(len(samples) / wall, 1),
               "backend_calls": {k: sum(r[phase]["reached"][k] for r in rounds) for k in ("prefill_requests",
                                                                                            "decode_requests")}}
        if None not in cpu:
            row["router_cpu_us_per_request"] = round(1e6 * sum(cpu) / max(1, len(samples)), 1)
            row["router_cpu_us_per_request_best_round"] = round(min(  # the round least disturbed by other load
                1e6 * r[phase]["router_cpu_s"] / max(1, len(r[phase]["samples"])) for r in rounds), 1)
            row["router_cpu_share"] = round(sum(cpu) / wall, 3)
        if phase == "stream":
            fb = [1000 * s.first_byte_s for s in samples]
            ft = [1000 * s.first_token_s for s in samples]
            row |= {"first_byte_ms_p50": round(percentile(fb, 0.5), 3), "first_byte_ms_p99": round(percentile(fb, 0.99), 3),
                    "first_token_ms_p50": round(percentile(ft, 0.5), 3),
                    "first_token_ms_p99": round(percentile(ft, 0.99), 3)}
        out[phase] = row
    return out


def compare(results: dict[str, dict]) -> dict:
    """Added latency vs direct per router, and ours / the best peer on each measure."""
    direct = results.get("direct")
    added = {}
    for name, r in results.items():
        if name == "direct" or not direct:
            continue
        added[name] = {
            "c1_p50_ms": round(r["c1"]["latency_ms_p50"] - direct["c1"]["latency_ms_p50"], 3),
            "c1_p99_ms": round(r["c1"]["latency_ms_p99"] - direct["c1"]["latency_ms_p99"], 3),
            "first_byte_p50_ms": round(r["stream"]["first_byte_ms_p50"] - direct["stream"]["first_byte_ms_p50"], 3),
            "first_token_p50_ms": round(r["stream"]["first_token_ms_p50"] - direct["stream"]["first_token_ms_p50"], 3),
        }
    peers = [p for p in PEERS if p in results]
    ratios: dict = {}
    if "ours" in results and peers:
        ours = results["ours"]
        measures = {  # name: (value of a result, lower is better)
            "added_c1_p50": (lambda n: added[n]["c1_p50_ms"], True),
            "added_c1_p99": (lambda n: added[n]["c1_p99_ms"], True),
            "c32_requests_per_s": (lambda n: results[n]["c32"]["requests_per_s"], False),
            "cpu_us_per_request_c1": (lambda n: results[n]["c1"].get("router_cpu_us_per_request"), True),
            "cpu_us_per_request_c32": (lambda n: results[n]["c32"].get("router_cpu_us_per_request"), True),
            "cpu_us_per_request_stream": (lambda n: results[n]["stream"].get("router_cpu_us_per_request"), True),
            "cpu_us_per_request_c32_best_round": (
                lambda n: results[n]["c32"].get("router_cpu_us_per_request_best_round"), True),
            "added_first_byte_p50": (lambda n: added[n]["first_byte_p50_ms"], True),
            "added_first_token_p50": (lambda n: added[n]["first_token_p50_ms"], True),
        }
        for measure, (value, lower) in measures.items():
            best = (min if lower else max)(peers, key=value)
            mine, theirs = value("ours"), value(best)
            ratios[measure] = {"ours": mine, "best_peer": best, "best_peer_value": theirs,
                               "ours_over_best": round(mine / theirs, 2) if theirs else None,
                               "no_worse": mine <= theirs if lower else mine >= theirs}
    return {"added_vs_direct": added, "ours_vs_best_peer": ratios}


def print_table(results: dict[str, dict], comparison: dict) -> None:
    added = comparison["added_vs_direct"]
    print(f"\n{'target':<14} {'c1 p50':>8} {'c1 p99':>8} {'+p50':>7} {'+p99':>7} {'c32 rps':>8} {'c32 p50':>8} "
          f"{'cpu/req c1':>10} {'cpu/req c32':>11} {'cpu/stream':>10} {'1st byte':>8} {'1st tok':>8}")
    for name, r in results.items():
        a = added.get(name, {})
        print(f"{name:<14} {r['c1']['latency_ms_p50']:>8.3f} {r['c1']['latency_ms_p99']:>8.3f} "
              f"{a.get('c1_p50_ms', 0):>7.3f} {a.get('c1_p99_ms', 0):>7.3f} {r['c32']['requests_per_s']:>8.0f} "
              f"{r['c32']['latency_ms_p50']:>8.2f} {r['c1'].get('router_cpu_us_per_request', 0):>8.0f}us "
              f"{r['c32'].get('router_cpu_us_per_request', 0):>9.0f}us {r['stream'].get('router_cpu_us_per_request', 0):>8.0f}us "
              f"{r['stream']['first_byte_ms_p50']:>8.2f} "
              f"{r['stream']['first_token_ms_p50']:>8.2f}")
    print("(ms unless marked; +p50/+p99: added over direct at c=1; 1st byte/tok: stream p50)")
    for measure, row in comparison["ours_vs_best_peer"].items():
        print(f"ours / best peer ({row['best_peer']}) on {measure}: {row['ours']} vs {row['best_peer_value']} "
              f"= {row['ours_over_best']}x{'' if row['no_worse'] else '  (worse)'}")


def plot(results: dict[str, dict], comparison: dict, path: Path, title: str) -> None:
    plt = pyplot()
    names = list(results)
    routers = [n for n in names if n != "direct"]
    added = comparison["added_vs_direct"]
    fig, axes = plt.subplots(1, 4, figsize=(16, 4))
    panels = [
        ("added latency at c=1 (ms)", routers, [("p50", [added[n]["c1_p50_ms"] for n in routers]),
                                                 ("p99", [added[n]["c1_p99_ms"] for n in routers])]),
        ("throughput at c=32 (requests/s)", names, [("", [results[n]["c32"]["requests_per_s"] for n in names])]),
        ("router CPU per request (µs)", routers, [(label, [results[n][phase]["router_cpu_us_per_request"] for n in routers])
                                                 for label, phase in (("c=1", "c1"), ("c=32", "c32"),
                                                                      ("stream", "stream"))]),
        ("stream p50 (ms)", names, [("first byte", [results[n]["stream"]["first_byte_ms_p50"] for n in names]),
                                    ("first token", [results[n]["stream"]["first_token_ms_p50"] for n in names])]),
    ]
    for ax, (label, xs, series) in zip(axes, panels):
        width = 0.8 / len(series)
        for i, (name, values) in enumerate(series):
            pos = [x + (i - (len(series) - 1) / 2) * width for x in range(len(xs))]
            bars = ax.bar(pos, values, width, label=name or None)
            ax.bar_label(bars, fmt="%.3g", fontsize=7)
        ax.set_xticks(range(len(xs)), xs, fontsize=8)
        ax.set_title(label, fontsize=9)
        ax.grid(axis="y", alpha=0.3)
        if len(series) > 1:
            ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    save_figure(fig, path)


# --- main ------------------------------------------------------------------------------------
def build_parser():
    p = make_parser(__doc__)
    p.add_argument("--peers-venv", default=os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")),
                                                        "epd-stage", "peer-routers-venv"),
                   help="venv the peer routers are installed into (created on first use)")
    p.add_argument("--targets", default="direct,ours,sglang-router,vllm-router", help="comma-separated")
    p.add_argument("--requests-c1", type=int, default=1500, help="non-stream requests at concurrency 1, per round")
    p.add_argument("--requests-stream", type=int, default=300, help="stream requests at concurrency 1, per round")
    p.add_argument("--requests-c32", type=int, default=4000, help="requests at --concurrency, per round")
    p.add_argument("--concurrency", type=int, default=32, help="the throughput level")
    p.add_argument("--warmup", type=int, default=100, help="untimed requests per target and round")
    p.add_argument("--rounds", type=int, default=3, help="the sequence of targets runs this many times (pooled)")
    p.add_argument("--itl-ms", type=float, default=2.0, help="the fake decode's gap before each streamed token")
    p.add_argument("--router-cores", default="1", help="cores of every router ('' : no pinning)")
    p.add_argument("--client-cores", default="0", help="cores of this process (the client)")
    p.add_argument("--backend-cores", default="0", help="cores of the fake backend pair")
    p.add_argument("--py-spy", action="store_true", help="record our router with py-spy during an extra c=32 run")
    add_output_args(p, "router_overhead", quick_help="smoke run: 1 round, a quarter of the requests")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.rounds = 1
        args.requests_c1, args.requests_stream, args.requests_c32 = (args.requests_c1 // 4, args.requests_stream // 4,
                                                                     args.requests_c32 // 4)
    out = output_path(args)
    started = time.time()
    venv = Path(args.peers_venv).expanduser()
    targets = [t for t in args.targets.split(",") if t]
    versions, skipped = ensure_peers(venv) if set(targets) & set(PEERS) else ({}, {})
    client_cores = pin_this_process(args.client_cores)
    router_cores = parse_cores(args.router_cores)
    info = machine_info()
    ports = {"prefill": free_port(), "decode": free_port(), "bootstrap": free_port()}
    prefill, decode = f"http://127.0.0.1:{ports['prefill']}", f"http://127.0.0.1:{ports['decode']}"
    backend = Proc("fake backend", [sys.executable, str(REPO / "bench" / "fake_backend.py"),
                                    "--prefill-port", str(ports["prefill"]), "--decode-port", str(ports["decode"]),
                                    "--bootstrap-port", str(ports["bootstrap"]), "--tokens", str(TOKENS),
                                    "--itl-ms", str(args.itl_ms)],
                   parse_cores(args.backend_cores), out.with_name(out.stem + "_backend.log"), url=decode)
    routers: dict[str, Proc] = {}
    try:
        backend.wait("/health")
        for name in targets:
            if name == "direct" or name in skipped:
                continue
            port = free_port()
            proc = Proc(name, router_argv(name, venv, port, prefill, decode, ports["bootstrap"]), router_cores,
                        out.with_name(out.stem + f"_{name}.log"), url=f"http://127.0.0.1:{port}")
            try:
                proc.wait("/health")
                routers[name] = proc
            except RuntimeError as exc:
                proc.stop()
                skipped[name] = str(exc)
                print(f"skipping {name}: {exc}", flush=True)
        live = [t for t in targets if t == "direct" or t in routers]
        print(f"targets {live}; client pid {os.getpid()} on cores {client_cores or 'any'}, routers on "
              f"{router_cores or 'any'}, backend on {args.backend_cores or 'any'}; load {loadavg()}", flush=True)
        runs: dict[str, list[dict]] = {t: [] for t in live}
        meters = []
        for round_index in range(args.rounds):
            order = live if round_index % 2 == 0 else live[::-1]
            for target in order:
                print(f"--- round {round_index + 1}/{args.rounds}: {target}", flush=True)
                meter = CpuMeter({os.getpid(), backend.proc.pid, *(r.proc.pid for r in routers.values())},
                                 "client_cpu_s")
                runs[target].append(asyncio.run(_measure(target, routers.get(target), prefill, decode,
                                                         ports["bootstrap"], args)))
                meters.append({"round": round_index + 1, "target": target, **meter.done()})
        profile = _profile(routers["ours"], venv, out, args) if args.py_spy and "ours" in routers else None
        threads = {name: thread_cpu(r.proc.pid) for name, r in routers.items()}
    finally:
        for proc in [*routers.values(), backend]:
            proc.stop()

    failed = {t: [e for r in runs[t] for phase in r.values() for e in phase["errors"]][:5]
              for t in live if any(not phase["samples"] for r in runs[t] for phase in r.values())}
    for target, errors in failed.items():
        print(f"{target}: a phase got no answer right; first errors: {errors}", flush=True)
    results = {t: summarize(t, runs[t]) for t in live if t not in failed}
    for t, r in results.items():
        for phase in ("c1", "stream", "c32"):
            expected = r[phase]["requests"] + r[phase]["errors"]
            calls = r[phase]["backend_calls"]
            r[phase]["each_stage_reached_once"] = calls["prefill_requests"] == calls["decode_requests"] == expected
    comparison = compare(results)
    report = {
        "benchmark": "router_overhead",
        "machine": info,
        "pinning": {"routers": router_cores or None, "client": {"pid": os.getpid(), "cores": client_cores or None},
                    "backend": {"pid": backend.proc.pid, "cores": parse_cores(args.backend_cores) or None}},
        "config": {"targets": live, "requests_c1": args.requests_c1, "requests_stream": args.requests_stream,
                   "requests_c32": args.requests_c32, "concurrency": args.concurrency, "rounds": args.rounds,
                   "warmup": args.warmup, "tokens": TOKENS, "itl_ms": args.itl_ms, "quick": args.quick,
                   "backend": "bench/fake_backend.py (no model)", "policies": "round_robin for prefill and decode",
                   "router_argv": {n: r.argv for n, r in routers.items()}},
        "peer_versions": versions,
        "skipped": skipped,
        "failed": failed,
        "results": results,
        **comparison,
        "phases": meters,
        "router_threads": threads,
        "py_spy": profile,
        "total_s": round(time.time() - started, 1),
    }
    write_json(out, report)
    png = out.with_suffix(".png")
    plot(results, comparison, png, f"router overhead, PD mode, fake backends; routers on core(s) {args.router_cores}, "
                                   f"client {args.client_cores}, backend {args.backend_cores}; {args.rounds} round(s)")
    print_table(results, comparison)
    print(f"wrote {out} and {png} ({report['total_s']} s)")
    return 0


async def _measure(target: str, router: Proc | None, prefill: str, decode: str, bootstrap: int, args) -> dict:
    client = Client(target, router.url if router else "", None if router else (prefill, decode, bootstrap))
    try:
        return await measure(client, router, decode, args)
    finally:
        await client.close()


def _profile(router: Proc, venv: Path, out: Path, args) -> dict | None:
    """py-spy (from the peers' venv) on our router during one more c=32 run: raw stacks + a summary."""
    py_spy = venv / "bin" / "py-spy"
    if not py_spy.exists():
        return None
    raw = out.with_name(out.stem + "_pyspy_ours.txt")
    spy = subprocess.Popen([str(py_spy), "record", "--pid", str(router.proc.pid), "--format", "raw", "--rate", "250",
                            "--output", str(raw), "--nonblocking"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.0)  # let py-spy attach

    async def load() -> None:
        client = Client("ours", router.url, None)
        try:
            await run_level(client, args.concurrency, args.requests_c32, False)
        finally:
            await client.close()

    asyncio.run(load())
    spy.send_signal(signal.SIGINT)
    try:
        spy.wait(30)
    except subprocess.TimeoutExpired:
        spy.kill()
    return {"raw": str(raw), **py_spy_summary(raw)} if raw.exists() else None


if __name__ == "__main__":
    sys.exit(main())
