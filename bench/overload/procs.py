"""Resident memory, open file descriptors and threads of processes, from ``/proc`` (Linux), and a
sampler that reads them for a set of named processes on a thread at a fixed interval."""

from __future__ import annotations

import multiprocessing
import os
import time
from pathlib import Path

from bench.common.proc import process_tree

KIB_PER_MIB = 1024
STOP_GRACE_S = 10.0


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
    """Every ``every_s`` seconds (the first at once) until ``stop()``: the ``usage`` of each of ``pids``
    ({name: pid}), as {"t": seconds since the sampler was made, name: usage or None}. The sampling runs
    in a forked child process, so a client busy on this process's GIL (hundreds of coroutines) does not
    delay it; make it before any event loop or client starts (it forks)."""

    def __init__(self, pids: dict[str, int], every_s: float) -> None:
        self.pids, self.every_s = dict(pids), every_s
        self.t0 = time.monotonic()
        context = multiprocessing.get_context("fork")
        self._stop = context.Event()
        self._rows, child_end = context.Pipe(duplex=False)
        self._proc = context.Process(target=_sample_until, args=(self.pids, every_s, self.t0, self._stop, child_end),
                                     name="proc-sampler", daemon=True)
        self._proc.start()
        child_end.close()

    def stop(self) -> list[dict]:
        """Stops the sampling (one last sample is taken then) and returns every sample; [] if the child
        sent nothing within ``every_s`` + 10 s."""
        self._stop.set()
        samples = self._rows.recv() if self._rows.poll(self.every_s + STOP_GRACE_S) else []
        self._proc.join(STOP_GRACE_S)
        return samples


def sample(pids: dict[str, int], t0: float) -> dict:
    """One sample now: {"t": seconds since ``t0`` (monotonic), name: usage(pid) or None}."""
    row: dict = {"t": round(time.monotonic() - t0, 2)}
    row.update({name: usage(pid) for name, pid in pids.items()})
    return row


def _sample_until(pids: dict[str, int], every_s: float, t0: float, stop, rows) -> None:
    """The sampler's child: samples until ``stop`` is set, then one more, and sends them all at once."""
    samples = []
    while not stop.is_set():
        samples.append(sample(pids, t0))
        stop.wait(every_s)
    samples.append(sample(pids, t0))
    rows.send(samples)
