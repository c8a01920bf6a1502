"""One phase: start its servers (pinned), measure the workloads, stop them; with the phase's CPU
meters and the other work on the servers' cores."""

from __future__ import annotations

import asyncio
import os
import time
from argparse import Namespace
from pathlib import Path

from bench.common.children import Server
from bench.common.machine import loadavg
from bench.common.meter import CpuMeter
from bench.ttft_pd.analysis import summarize
from bench.ttft_pd.client import measure
from bench.ttft_pd.workload import Bodies


def run_phase(name: str, roles: dict[str, list[str]], cores: dict[str, list[int]], args: Namespace, model: Path,
              bodies: Bodies, out: Path, round_index: int = 1) -> dict:
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
        samples = asyncio.run(measure(servers, bodies, args, round_index, bootstrap_port))
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
              "servers": {r: {"pid": s.proc.pid, "cores": s.cores or None, "cmd": s.argv, "log": str(s.log_path)}
                          for r, s in servers.items()},
              "workloads": {w: summarize(v) for w, v in samples.items()},
              "samples": samples}
    for w, summary in result["workloads"].items():
        kv = f", KV write {summary['kv_write_ms_median']:.2f} ms ({summary['kv_bytes'] / 2**20:.2f} MiB)" \
            if "kv_write_ms_median" in summary else ""
        print(f"[{name}] {w:<11} {summary['prompt_tokens']:>5} prompt tokens ({summary['cached_tokens_median']} cached): "
              f"TTFT median {summary['ttft_ms_median']:.1f} ms, p90 {summary['ttft_ms_p90']:.1f}, "
              f"min {summary['ttft_ms_min']:.1f}{kv}", flush=True)
    print(f"[{name}] load {phase['loadavg_1m']}, core busy {phase['core_busy_fraction']}, server CPU s "
          f"{phase['server_cpu_s']}, other CPU s on the server cores {phase['other_cpu_s_on_server_cores']}", flush=True)
    return result
