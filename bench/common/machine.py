"""Where a result was measured: CPU model and cores, memory, platform, Python and package versions,
the git commit of this checkout and whether it had uncommitted changes (``git status --porcelain``).
Reads /proc and runs git; imports nothing heavy (versions come from the installed metadata)."""

from __future__ import annotations

import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
GIT_TIMEOUT_S = 10.0


def machine_info() -> dict:
    """CPU, core count, the cores this process may use now, memory, platform, versions, commit, dirty."""
    return {"cpu": _proc_field("/proc/cpuinfo", "model name"), "cpu_count": os.cpu_count(),
            "cpus_available": sorted(os.sched_getaffinity(0)), "mem_gib": _mem_gib(),
            "platform": platform.platform(), "python": platform.python_version(),
            "torch": _version("torch"), "transformers": _version("transformers"),
            "git_commit": git_commit(), "git_dirty": git_dirty()}


def loadavg() -> float | None:
    """The 1-minute load average (None where /proc/loadavg cannot be read)."""
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except OSError:
        return None


def git_commit() -> str | None:
    """The short commit of this checkout (None outside one)."""
    out = _git("rev-parse", "--short", "HEAD")
    return (out or "").strip() or None


def git_dirty() -> bool | None:
    """Whether ``git status --porcelain`` lists anything beside ``bench/summaries/`` (None outside a
    checkout): the summaries are the runs' own output, so a run after another is not made dirty by it."""
    out = _git("status", "--porcelain", "--", ".", ":(exclude)bench/summaries")
    return bool(out.strip()) if out is not None else None


def _git(*argv: str) -> str | None:
    if not (REPO / ".git").exists():
        return None
    try:
        done = subprocess.run(["git", *argv], cwd=REPO, capture_output=True, text=True, timeout=GIT_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _proc_field(path: str, name: str) -> str | None:
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(name):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def _mem_gib() -> float | None:
    total = _proc_field("/proc/meminfo", "MemTotal")
    return round(int(total.split()[0]) / 2**20, 1) if total else None
