"""CPU time and processes from ``/proc``: one parser of ``/proc/PID[/task/TID]/stat``, and what the
benchmarks read with it (a process's or a process tree's CPU seconds, its busiest threads, every
process's CPU, a process group's members), plus the machine's and each core's busy fraction from
``/proc/stat``. Linux only; 10 ms clock ticks, except ``tree_run_seconds`` (the scheduler's ns)."""

from __future__ import annotations

import os
from pathlib import Path

# indexes into the fields after the command name of /proc/PID/stat (proc(5) numbers minus 3)
PPID, PGRP, UTIME, STIME, PROCESSOR = 1, 2, 11, 12, 36


def read_stat(path: Path) -> tuple[str, list[str]]:
    """(command name, the fields after it) of a ``/proc/PID[/task/TID]/stat`` file. Raises OSError."""
    stat = path.read_text()
    return stat[stat.index("(") + 1:stat.rindex(")")], stat.rpartition(")")[2].split()


def stat_cpu_s(fields: list[str]) -> float:
    """utime + stime in seconds, from the fields after the command name."""
    return (int(fields[UTIME]) + int(fields[STIME])) / os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads). Raises OSError once it is gone."""
    return stat_cpu_s(read_stat(Path(f"/proc/{pid}/stat"))[1])


def tree_cpu_seconds(root: int) -> float:
    """utime + stime of ``root`` and every live descendant (a process gone meanwhile counts 0)."""
    total = 0.0
    for pid in process_tree(root):
        try:
            total += cpu_seconds(pid)
        except OSError:
            continue
    return total


def tree_run_seconds(root: int) -> float:
    """CPU seconds of the live threads of ``root`` and its live descendants, from the scheduler's own
    nanosecond count (``/proc/PID/task/TID/schedstat``) instead of 10 ms ticks: a short phase's CPU
    without the ticks' rounding. A thread that ended is not counted (use it on processes whose threads
    outlive the phase, as a router's do); where schedstat is missing, ``tree_cpu_seconds``."""
    total = 0.0
    for pid in process_tree(root):
        try:
            tasks = list(Path(f"/proc/{pid}/task").iterdir())
        except OSError:
            continue
        for task in tasks:
            try:
                total += int((task / "schedstat").read_text().split()[0]) / 1e9
            except FileNotFoundError:
                return tree_cpu_seconds(root)
            except OSError:
                continue
    return total


def _processes() -> list[tuple[int, str, list[str]]]:
    """(pid, command name, stat fields) of every process readable now."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                out.append((int(entry.name), *read_stat(entry / "stat")))
            except (OSError, ValueError):
                continue
    return out


def process_tree(root: int) -> list[int]:
    """``root`` and every live descendant (from the parent pids in /proc/*/stat)."""
    children: dict[int, list[int]] = {}
    for pid, _, fields in _processes():
        children.setdefault(int(fields[PPID]), []).append(pid)
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def group_pids(pgid: int) -> list[int]:
    """The processes whose process group is ``pgid`` (the leader first)."""
    pids = [pid for pid, _, fields in _processes() if int(fields[PGRP]) == pgid]
    return sorted(pids, key=lambda pid: pid != pgid)


def thread_cpu(pid: int, top: int = 8) -> list[list]:
    """The process's busiest threads since it started: [name, CPU seconds], from /proc/PID/task."""
    rows: list[tuple[str, float]] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name, fields = read_stat(task / "stat")
            rows.append((name, round(stat_cpu_s(fields), 2)))
        except (OSError, ValueError):
            continue
    return [list(row) for row in sorted(rows, key=lambda r: -r[1])[:top]]


def process_cpu() -> dict[int, tuple[str, float, int]]:
    """pid -> (command line, CPU seconds, last core) of every process on the machine."""
    out = {}
    for pid, name, fields in _processes():
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            out[pid] = (cmdline[:160] or name, stat_cpu_s(fields), int(fields[PROCESSOR]))
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
    """1 - (idle + iowait) / total between two jiffy rows of /proc/stat. Pure."""
    if not stat0 or not stat1:
        return None
    d = [b - a for a, b in zip(stat0, stat1)]
    total = sum(d[:8])
    return round(1 - (d[3] + d[4]) / total, 3) if total else None


def core_busy(stat0: dict, stat1: dict) -> dict[str, float | None]:
    """Busy fraction of the machine and of each core between two proc_stat() snapshots. Pure."""
    return {name: busy_fraction(stat0.get(name), stat1.get(name)) for name in stat1}
