"""Per-run log directories under the cache directory (``stage up``, ``stage demo``): each run gets a
fresh ``KIND-YYYYmmdd-HHMMSS-PID`` directory, and only the newest ``KEEP_RUNS`` run directories of
the parent are kept. Nothing else in the parent is ever removed (a directory the user named with
``--log-dir`` is not pruned at all)."""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path

KEEP_RUNS = 10
RUN_DIR = re.compile(r"^[a-z][a-z-]*-(\d{8}-\d{6})-(\d+)$")


def new_run_dir(parent: Path, kind: str, keep: int = KEEP_RUNS) -> Path:
    """A fresh, created ``parent/KIND-YYYYmmdd-HHMMSS-PID``, after removing all but the newest
    ``keep - 1`` earlier run directories of ``parent`` (so ``keep`` remain with this one)."""
    path = parent / time.strftime(f"{kind}-%Y%m%d-%H%M%S-{os.getpid()}")
    path.mkdir(parents=True, exist_ok=True)
    for old in stale_runs(parent, keep):
        shutil.rmtree(old, ignore_errors=True)
    return path


def stale_runs(parent: Path, keep: int) -> list[Path]:
    """The run directories of ``parent`` beyond its newest ``keep``, oldest first (by the time and
    pid in their names)."""
    runs = [(m[1], int(m[2]), entry) for entry in parent.iterdir()
            if entry.is_dir() and (m := RUN_DIR.match(entry.name))]
    ordered = [entry for *_, entry in sorted(runs, key=lambda run: run[:2])]
    return ordered[:max(0, len(ordered) - keep)]
