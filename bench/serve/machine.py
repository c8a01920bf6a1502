"""Where a result was measured: CPU model and cores, memory, platform, Python, the git commit of this
checkout (None outside one). Reads /proc and runs git; imports nothing heavy."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def machine_info() -> dict:
    return {"cpu": _proc_field("/proc/cpuinfo", "model name"), "cpu_count": os.cpu_count(),
            "mem_gib": _mem_gib(), "platform": platform.platform(), "python": platform.python_version(),
            "git_commit": _git_commit()}


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


def _git_commit() -> str | None:
    if not (REPO / ".git").exists():
        return None
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                             timeout=10)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None
