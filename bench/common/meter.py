"""The machine while a benchmark runs: ``CpuMeter`` over one interval (a phase), ``LoadSampler`` over
a whole run (the load average the run's summary reports)."""

from __future__ import annotations

import threading
import time

from bench.common.machine import loadavg
from bench.common.proc import core_busy, proc_stat, process_cpu, top_processes

LOAD_EVERY_S = 5.0


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


class LoadSampler:
    """The 1-minute load average every ``every_s`` seconds on a daemon thread, from when it is made
    until ``stop()``, which returns {"min", "max", "samples"} (None values where unreadable)."""

    def __init__(self, every_s: float = LOAD_EVERY_S) -> None:
        self.every_s, self.samples = every_s, [loadavg()]
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="load-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopped.wait(self.every_s):
            self.samples.append(loadavg())

    def stop(self) -> dict:
        self._stopped.set()
        self._thread.join(self.every_s + 1)
        self.samples.append(loadavg())
        known = [s for s in self.samples if s is not None]
        return {"min": min(known) if known else None, "max": max(known) if known else None,
                "samples": len(self.samples)}
