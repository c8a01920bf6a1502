"""One benchmark run's record: the full JSON (``--out``, under the ignored ``bench/results/``) and a
small summary (``--summary-dir``, by default the committed ``bench/summaries/``) that bench/README.md's
"Latest figures" table is generated from (``python -m bench.summaries --write-readme``).

A summary, one file per benchmark and configuration (the latest run of each)::

    {"benchmark": "epd_cache", "configuration": "image_size=448",   # flags that differ from the defaults
     "command": "python -m bench.epd_cache --image-size 448", "date": "2026-12-02",
     "commit": "abc1234", "dirty": false,                          # git status --porcelain at the start
     "machine": {"cpu": ..., "cpu_count": 2, "mem_gib": 23.5},
     "load_1m": {"min": 0.4, "max": 0.9, "samples": 25},           # sampled during the run
     "duration_s": 121.3, "full_results": "bench/results/epd_cache.json",
     "figures": [{"name": "TTFT hit / miss, 1 image", "value": 0.42, "unit": "x"}, ...]}

The pure parts (``Figure``, ``configuration``, ``summary_name``, ``build_summary``, ``problems``) are
tested in tests/bench/test_summaries.py; ``Recorder`` does the I/O.
"""

from __future__ import annotations

import argparse
import hashlib
import shlex
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.common.machine import REPO, machine_info
from bench.common.meter import LoadSampler
from bench.common.output import write_json

NOT_CONFIGURATION = frozenset({"out", "summary_dir", "cache_dir", "py_spy", "peers_venv", "startup_timeout",
                               "request_timeout"})  # flags that do not change what is measured
DEFAULT = "default"
MAX_NAME = 64  # characters of a configuration in a summary's file name
FIELDS: dict[str, type | tuple[type, ...]] = {"benchmark": str, "configuration": str, "command": str, "date": str, "commit": (str, type(None)),
          "dirty": (bool, type(None)), "machine": dict, "load_1m": dict, "duration_s": (int, float),
          "full_results": str, "figures": list}
MACHINE_FIELDS = ("cpu", "cpu_count", "mem_gib")


@dataclass(frozen=True)
class Figure:
    """One headline figure: what it is (``name``, saying what over what for a ratio), its ``value``
    (a number, or None where the run could not measure it) and its ``unit`` (``x`` for a ratio)."""

    name: str
    value: float | int | None
    unit: str


def configuration(defaults: dict, given: dict, ignore: Iterable[str] = NOT_CONFIGURATION) -> str:
    """The flags of a run that differ from the parser's defaults, as ``name=value`` joined by ``,``
    in name order (``quick`` for a bare ``--quick``); ``default`` when none does."""
    skip = set(ignore)
    parts = []
    for name in sorted(given):
        value = given[name]
        if name in skip or value == defaults.get(name):
            continue
        parts.append(name if value is True else f"{name}={_flat(value)}")
    return ",".join(parts) or DEFAULT


def _flat(value) -> str:
    return ";".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)


def summary_name(benchmark: str, config: str) -> str:
    """The summary's file name: ``<benchmark>.json`` for the defaults, else ``<benchmark>--<config>.json``
    with every character but letters, digits and ``=.,-_`` made ``_``; a configuration longer than
    ``MAX_NAME`` characters is cut there and ended with 8 hex digits of its SHA-1 (the file holds it whole)."""
    if config == DEFAULT:
        return f"{benchmark}.json"
    safe = "".join(c if c.isalnum() or c in "=.,-_" else "_" for c in config)
    if len(safe) > MAX_NAME:
        safe = f"{safe[:MAX_NAME - 9]}-{hashlib.sha1(config.encode()).hexdigest()[:8]}"
    return f"{benchmark}--{safe}.json"


def build_summary(*, benchmark: str, config: str, command: str, started: float, machine: dict, load: dict,
                  duration_s: float, full_results: str, figures: Sequence[Figure]) -> dict:
    """The summary dict (see the module's docstring) of a run that started at ``started`` (epoch s)."""
    return {"benchmark": benchmark, "configuration": config, "command": command,
            "date": time.strftime("%Y-%m-%d", time.gmtime(started)),
            "commit": machine.get("git_commit"), "dirty": machine.get("git_dirty"),
            "machine": {k: machine.get(k) for k in MACHINE_FIELDS},
            "load_1m": load, "duration_s": round(duration_s, 1), "full_results": full_results,
            "figures": [asdict(f) for f in figures]}


def problems(summary: dict) -> list[str]:
    """What is wrong with a summary read back (a missing or mistyped field, a figure without a name,
    unit or numeric value); [] for a valid one."""
    out = [f"{key}: missing or not {kind}" for key, kind in FIELDS.items() if not isinstance(summary.get(key), kind)]
    for i, figure in enumerate(summary.get("figures") or []):
        if not isinstance(figure, dict) or not figure.get("name") or not isinstance(figure.get("unit"), str):
            out.append(f"figures[{i}]: needs a name and a unit")
        elif figure.get("value") is not None and (isinstance(figure["value"], bool)
                                                  or not isinstance(figure["value"], (int, float))):
            out.append(f"figures[{i}] {figure['name']!r}: value is not a number")
    if not summary.get("figures"):
        out.append("figures: none")
    return out


class Recorder:
    """A run from when it is made: the machine (the commit and dirty flag as the run starts), the load
    average sampled every few seconds, the wall time. ``finish`` writes the full report to ``out`` and
    the summary to ``summary_dir``. A script makes it with ``start`` (or ``of_script``) right after
    parsing its flags, before ``--quick`` changes them, so the configuration is the flags as given."""

    def __init__(self, benchmark: str, config: str, command: str, summary_dir: Path) -> None:
        self.benchmark, self.config, self.command, self.summary_dir = benchmark, config, command, summary_dir
        self.started, self.t0 = time.time(), time.perf_counter()
        self.machine = machine_info()
        self.load = LoadSampler()

    @classmethod
    def start(cls, benchmark: str, parser: argparse.ArgumentParser,
              argv: Sequence[str] | None = None) -> tuple[argparse.Namespace, Recorder]:
        """Parse ``argv`` with the script's ``parser`` and start its recorder (``of_script``)."""
        args = parser.parse_args(argv)
        return args, cls.of_script(benchmark, parser, args, argv)

    @classmethod
    def of_script(cls, benchmark: str, parser: argparse.ArgumentParser, args: argparse.Namespace,
                  argv: Sequence[str] | None = None) -> Recorder:
        """The recorder of ``python -m bench.<benchmark>`` run with ``argv`` (default: this process's),
        its configuration from the flags that differ from ``parser``'s defaults, its summary in ``--summary-dir``."""
        command = shlex.join(["python", "-m", f"bench.{benchmark}", *(sys.argv[1:] if argv is None else argv)])
        return cls(benchmark, configuration(vars(parser.parse_args([])), vars(args)), command, Path(args.summary_dir))

    def elapsed_s(self) -> float:
        return time.perf_counter() - self.t0

    def finish(self, out: Path, report: dict, figures: Sequence[Figure] | None) -> Path | None:
        """Write ``report`` (with ``machine``, ``load_1m`` and ``total_s`` added) to ``out`` and the
        summary of ``figures``; returns the summary's path. No figures (None: a run that failed its
        own checks; or none measured): the report only, no summary (None)."""
        load, duration = self.load.stop(), self.elapsed_s()
        write_json(out, {**report, "machine": {**self.machine, **report.get("machine", {})}, "load_1m": load,
                         "total_s": round(duration, 1)})
        if not figures:
            return None
        summary = build_summary(benchmark=self.benchmark, config=self.config, command=self.command,
                                started=self.started, machine=self.machine, load=load, duration_s=duration,
                                full_results=_shown(out), figures=figures)
        path = self.summary_dir / summary_name(self.benchmark, self.config)
        write_json(path, summary)
        return path


def _shown(path: Path) -> str:
    """``path`` relative to the repo where it is inside it."""
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return str(path)
