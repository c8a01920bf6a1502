"""Core lists (``"0"``, ``"0,2"``, ``"0-3"``, ``""`` for none) and pinning: this process, or every
thread of another (Linux sets affinity per thread; threads started later inherit their parent's)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path


def parse_cores(text: str) -> list[int]:
    """Sorted core numbers of a list like ``"0"``, ``"0,2"`` or ``"0-3"``; ``""`` gives ``[]`` (no pinning). Pure."""
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


def pin_threads(pid: int, cores: Sequence[int]) -> None:
    """Every thread of ``pid`` on ``cores`` (none: left as it is; a thread that ends meanwhile is skipped)."""
    if not cores:
        return
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), cores)
        except ProcessLookupError:
            continue
