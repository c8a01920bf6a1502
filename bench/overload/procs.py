"""Resident memory, open file descriptors and threads of processes, from ``/proc`` (Linux), and a
sampler that reads them for a set of named processes on a thread at a fixed interval."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from bench.common.proc import process_tree

KIB_PER_MIB = 1024


def usage(root: int) -> dict[str, float] | None:
    """{"rss_mib", "fds", "threads"} of ``root`` and its live descendants summed; None once ``root``
    is gone. A descendant gone meanwhile counts 0."""
    total = {"rss_mib": 0.0, "fds": 0.0, "threads": 0.0}
    for pid in process_tree(root):
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            fds = len(os.listdir(f"/proc/{pid}/fd"))
        except OSError:
            if pid == root:
                return None
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        total["rss_mib"] += int(fields.get("VmRSS", "0 kB").split()[0]) / KIB_PER_MIB
        total["threads"] += int(fields.get("Threads", "0"))
        total["fds"] += fds
    return {"rss_mib": round(total["rss_mib"], 1), "fds": int(total["fds"]), "threads": int(total["threads"])}


class Sampler:
    """Every ``every_s`` seconds (the first at once), on a daemon thread until ``stop()``: the ``usage``
    of each of ``pids`` ({name: pid}), as {"t": seconds since start, name: usage or None}."""

    def __init__(self, pids: dict[str, int], every_s: float) -> None:
        self.pids, self.every_s = dict(pids), every_s
        self.samples: list[dict] = []
        self.t0 = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="proc-sampler", daemon=True)
        self._thread.start()

    def sample(self) -> dict:
        """One sample now, appended to ``samples`` and returned."""
        row: dict = {"t": round(time.monotonic() - self.t0, 2)}
        row.update({name: usage(pid) for name, pid in self.pids.items()})
        self.samples.append(row)
        return row

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.every_s)

    def stop(self) -> list[dict]:
        """Stops the thread (within ``every_s`` plus one sample), takes a last sample, returns them all."""
        self._stop.set()
        self._thread.join(self.every_s + 10)
        self.sample()
        return self.samples
