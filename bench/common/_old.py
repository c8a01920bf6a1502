"""What the benchmarks in ``bench/`` share: argument boilerplate, the checkpoint, machine info, core
pinning, CPU sampling from ``/proc``, ``stage serve`` subprocesses, the generated test image, and
writing the JSON and the plot.

Importing this module imports neither torch nor matplotlib (the benchmarks start their servers first).
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import math
import os
import platform
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from stages.cli import ensure_model, free_port, stop_process, wait_healthy  # no torch import

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"


# --- arguments and output --------------------------------------------------------------------
def make_parser(doc: str) -> argparse.ArgumentParser:
    """A parser described by the first paragraph of the benchmark's docstring, showing defaults."""
    return argparse.ArgumentParser(description=doc.split("\n\n")[0],
                                   formatter_class=argparse.ArgumentDefaultsHelpFormatter)


def add_model_args(p: argparse.ArgumentParser, family_help: str = "model family (stages.modelgen.FAMILIES)") -> None:
    """--family, --size, --model-dir, --cache-dir: which checkpoint (see ``resolve_model``)."""
    p.add_argument("--family", default="qwen2_vl", help=family_help)
    p.add_argument("--size", default="small", help="model size preset")
    p.add_argument("--model-dir", default=None, help="reuse this checkpoint; default: generated into the cache dir")
    p.add_argument("--cache-dir", default=os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")),
                                                       "epd-stage"), help="where generated checkpoints are kept")


def add_output_args(p: argparse.ArgumentParser, name: str, quick_help: str) -> None:
    """--quick (what it shortens: ``quick_help``) and --out (default ``bench/results/<name>.json``)."""
    p.add_argument("--quick", action="store_true", help=quick_help)
    p.add_argument("--out", default=str(RESULTS / f"{name}.json"), help="JSON path (PNG written next to it)")


def resolve_model(args) -> Path:
    """``--model-dir``, else the ``<family>-<size>`` checkpoint in ``--cache-dir``, generated on first use."""
    if args.model_dir:
        return Path(args.model_dir)
    return ensure_model(Path(args.cache_dir) / f"{args.family}-{args.size}", args.family, args.size)


def output_path(args) -> Path:
    """``--out`` as a Path, its folder created."""
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    return out


def write_json(path: Path, report: dict) -> None:
    """The report, indented, with a final newline."""
    path.write_text(json.dumps(report, indent=2) + "\n")


def pyplot():
    """``matplotlib.pyplot`` on the non-interactive Agg backend (imported late: it is the bench extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path, **savefig_kwargs) -> None:
    """Lay ``fig`` out, write it at 120 dpi and close it."""
    fig.tight_layout()
    fig.savefig(path, dpi=120, **savefig_kwargs)
    import matplotlib.pyplot as plt

    plt.close(fig)


# --- machine and pinning ---------------------------------------------------------------------
def machine_info() -> dict:
    """CPU model and count, the cores this process may use now, memory, platform, versions, git commit."""
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gib = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem_gib = round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    import torch
    import transformers

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                                timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "cpus_available": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "mem_gib": mem_gib,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "git_commit": commit,
    }


def parse_cores(text: str) -> list[int]:
    """Sorted core numbers of a list like ``"0"``, ``"0,2"`` or ``"0-3"``; ``""`` gives ``[]`` (no pinning)."""
    cores: set[int] = set()
    for part in text.split(","):
        if "-" in part:
            lo, hi = part.split("-")
            cores.update(range(int(lo), int(hi) + 1))
        elif part.strip():
            cores.add(int(part))
    return sorted(cores)


def pin_this_process(text: str) -> list[int]:
    """Pin this process to the cores in ``text`` (``parse_cores``), unless empty; returns them."""
    cores = parse_cores(text)
    if cores:
        os.sched_setaffinity(0, cores)
    return cores


# --- CPU sampling (/proc) --------------------------------------------------------------------
def loadavg() -> float | None:
    """The 1-minute load average."""
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except OSError:
        return None


def _read_stat(path: Path) -> tuple[str, list[str]]:
    """(command name, the fields after it) of a ``/proc/PID[/task/TID]/stat`` file."""
    stat = path.read_text()
    return stat[stat.index("(") + 1:stat.rindex(")")], stat.rpartition(")")[2].split()


def _stat_cpu_s(fields: list[str]) -> float:
    """utime + stime in seconds, from the fields after the command name."""
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads), from /proc."""
    return _stat_cpu_s(_read_stat(Path(f"/proc/{pid}/stat"))[1])


def thread_cpu(pid: int, top: int = 8) -> list[list]:
    """The process's busiest threads since it started: [name, CPU seconds], from /proc/PID/task."""
    rows = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name, fields = _read_stat(task / "stat")
            rows.append([name, round(_stat_cpu_s(fields), 2)])
        except (OSError, ValueError):
            continue
    return sorted(rows, key=lambda r: -r[1])[:top]


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


def busy_fraction(stat0: list[int] | None, stat1: list[int] | None) -> float | None:
    """1 - (idle + iowait) / total between two jiffy rows of /proc/stat."""
    if not stat0 or not stat1:
        return None
    d = [b - a for a, b in zip(stat0, stat1)]
    total = sum(d[:8])
    return round(1 - (d[3] + d[4]) / total, 3) if total else None


def core_busy(stat0: dict, stat1: dict) -> dict[str, float | None]:
    """Busy fraction of the machine and of each core between two proc_stat() snapshots."""
    return {name: busy_fraction(stat0.get(name), stat1.get(name)) for name in stat1}


def process_cpu() -> dict[int, tuple[str, float, int]]:
    """pid -> (command, CPU seconds, last core) of every process on the machine."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            name, fields = _read_stat(entry / "stat")
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            out[int(entry.name)] = (cmdline[:160] or name, _stat_cpu_s(fields), int(fields[36]))
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


class CpuMeter:
    """Over an interval: wall time, this process's CPU seconds (reported as ``cpu_key``), the machine's
    and each core's busy fraction (/proc/stat), the 1-minute load average at both ends and the other
    processes (all but ``exclude``) that used the CPU. Starts when made; ``done()`` reads it."""

    def __init__(self, exclude: set[int], cpu_key: str) -> None:
        self.exclude, self.cpu_key = exclude, cpu_key
        self.t0, self.cpu0, self.stat0, self.load0 = time.perf_counter(), time.process_time(), proc_stat(), loadavg()
        self.procs0 = process_cpu()
        self.wall_s: float | None = None  # unrounded, set by done()

    def done(self) -> dict:
        busy = core_busy(self.stat0, proc_stat())
        self.wall_s = time.perf_counter() - self.t0
        return {"wall_s": round(self.wall_s, 2),
                self.cpu_key: round(time.process_time() - self.cpu0, 2),
                "machine_busy_fraction": busy.pop("cpu", None), "core_busy_fraction": busy,
                "loadavg_1m": [self.load0, loadavg()],
                "other_processes": top_processes(self.procs0, process_cpu(), self.exclude)}


# --- servers ---------------------------------------------------------------------------------
class Server:
    """``stage serve <role>`` on a free loopback port with ``threads`` torch threads (on ``device``,
    its ``--device``), pinned to ``cores`` (empty: not pinned), stdout and stderr to ``log_path``.
    ``extra_env``: KEY=VALUE items for its environment; PYTHONPATH=DIR is prepended (e.g. a scratch
    copy of the engine to A/B)."""

    def __init__(self, role: str, model: Path, cores: list[int], threads: int, log_path: Path,
                 flags: Sequence[str] = (), extra_env: Sequence[str] = (), device: str = "cpu") -> None:
        self.role, self.cores, self.port, self.log_path = role, list(cores), free_port(), log_path
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [sys.executable, "-m", "stages.cli", "serve", role, "--model", str(model), "--port", str(self.port),
                    "--threads", str(threads), "--device", device, "--log-level", "warning", *flags]
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1",
                   PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
        for item in extra_env:
            key, _, value = item.partition("=")
            env[key] = os.pathsep.join([value, env[key]]) if key == "PYTHONPATH" else value
        with open(log_path, "wb") as log_file:
            self.proc = subprocess.Popen(self.cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        if self.cores:  # at once: the interpreter is still starting; its threads (torch, transfer) inherit this
            os.sched_setaffinity(self.proc.pid, self.cores)

    def wait(self, timeout_s: float) -> None:
        """Until /health answers; on failure raise RuntimeError with the end of the server's log."""
        try:
            wait_healthy(self.url, self.proc, timeout_s)
        except (RuntimeError, TimeoutError) as exc:
            tail = self.log_path.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{self.role} server: {exc}\n{tail}") from None

    def cpu(self) -> float:
        """CPU seconds of the server so far (NaN once it is gone)."""
        try:
            return cpu_seconds(self.proc.pid)
        except OSError:
            return float("nan")

    def threads(self, top: int = 8) -> list[list]:
        """Its busiest threads: [name, CPU seconds]."""
        return thread_cpu(self.proc.pid, top)

    def stop(self) -> None:
        stop_process(self.proc)


# --- workload and statistics -----------------------------------------------------------------
def make_image(index: int, size: int = 64):
    """A small PNG: a gradient with a coloured square whose place and colour depend on ``index``."""
    from PIL import Image, ImageDraw

    image = Image.linear_gradient("L").resize((size, size)).convert("RGB")
    draw = ImageDraw.Draw(image)
    x = (index * 13) % (size // 2)
    y = (index * 7) % (size // 2)
    draw.rectangle((x, y, x + size // 3, y + size // 3), fill=((60 * index) % 256, 120, (255 - 40 * index) % 256))
    return image


def image_url(image) -> str:
    """A PIL image as a PNG ``data:`` URL."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank ``q`` quantile (0 < q <= 1) of ``values``."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]
