"""The peer routers (installed from PyPI into their own venv, never the project's) and the command
line of every router the benchmark starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from process.ports import free_port

PEERS = {"sglang-router": "sglang-router==0.3.2", "vllm-router": "vllm-router==0.1.17"}
PY_SPY = ("py-spy", "py-spy==0.4.3")


def ensure_peers(venv: Path) -> tuple[dict[str, str], dict[str, str]]:
    """Install the peer routers (and py-spy) into ``venv`` once. Returns (versions by package,
    install errors by package)."""
    pip = venv / "bin" / "pip"
    if not pip.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    versions, errors = {}, {}
    for name, spec in [*PEERS.items(), PY_SPY]:
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


OURS = ("ours", "ours-base", "ours-epd", "ours-base-epd", *("ours-traced", "ours-traced-1pct"))
# -base: the --baseline checkout; -epd: epd mode; -traced: OpenTelemetry traces kept at 100 % / 1 % (TRACED)
TRACED = {"ours-traced": "1", "ours-traced-1pct": "0.01"}  # target -> --otlp-traces-sample-ratio


def router_argv(name: str, venv: Path, port: int, prefill: str, decode: str, bootstrap: int,
                epd: tuple[str, str] | None = None, traces: str | None = None) -> list[str]:
    """The command line of router ``name`` (one of ``OURS``, or a peer) on ``port`` in front of the pair,
    with round-robin for both roles and the peers' metrics on loopback; ``epd``: (the fake encoder's
    URL, the Redis URL) for the ``-epd`` targets; ``traces``: the OTLP endpoint of the ``-traced`` ones."""
    bin_ = venv / "bin"
    if name in OURS:  # -base: -P, so the baseline checkout on PYTHONPATH is imported, not this one
        mode = ["--encoder", epd[0], "--redis-url", epd[1]] if name.endswith("-epd") and epd else []
        if name in TRACED and traces:
            mode += ["--otlp-traces-endpoint", traces, "--otlp-traces-sample-ratio", TRACED[name]]
        return [sys.executable, *(["-P"] if "-base" in name else []), "-m", "cli", "serve", "router",
                "--host", "127.0.0.1", "--port", str(port), "--prefill", prefill, "--decode", decode, *mode,
                "--policy-prefill", "round_robin", "--policy-decode", "round_robin", "--log-level", "warning"]
    metrics = ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
    if name == "sglang-router":
        return [str(bin_ / "python"), "-m", "sglang_router.launch_router", "--pd-disaggregation",
                "--prefill", prefill, str(bootstrap), "--decode", decode, "--host", "127.0.0.1", "--port", str(port),
                "--policy", "round_robin", "--log-level", "warn", *metrics]
    return [str(bin_ / "vllm-router"), "--vllm-pd-disaggregation", "--prefill", prefill, "--decode", decode,
            "--host", "127.0.0.1", "--port", str(port), "--policy", "round_robin", "--log-level", "error", *metrics]
