"""The flags every benchmark script shares, and the checkpoint they name."""

from __future__ import annotations

import argparse
from pathlib import Path

from stages.launch.models import cache_dir, ensure_model  # no torch import

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "bench" / "results"
SUMMARIES = REPO / "bench" / "summaries"
CACHE = str(cache_dir())


def make_parser(doc: str, module: str) -> argparse.ArgumentParser:
    """The parser of ``python -m <module>``, described by the first paragraph of its docstring, showing defaults."""
    return argparse.ArgumentParser(prog=f"python -m {module}", description=doc.split("\n\n")[0],
                                   formatter_class=argparse.ArgumentDefaultsHelpFormatter)


def add_model_args(p: argparse.ArgumentParser, family_help: str = "model family (stages.modelgen.FAMILIES)") -> None:
    """--family, --size, --model-dir, --cache-dir: which checkpoint (see ``resolve_model``)."""
    p.add_argument("--family", default="qwen2_vl", help=family_help)
    p.add_argument("--size", default="small", help="model size preset")
    p.add_argument("--model-dir", default=None, help="reuse this checkpoint; default: generated into the cache dir")
    p.add_argument("--cache-dir", default=CACHE, help="where generated checkpoints are kept")


def add_output_args(p: argparse.ArgumentParser, name: str, quick_help: str) -> None:
    """--quick (what it shortens: ``quick_help``), --out (default ``bench/results/<name>.json``) and
    --summary-dir (where the run's summary goes: ``bench/summaries/`` by default, committed)."""
    p.add_argument("--quick", action="store_true", help=quick_help)
    p.add_argument("--out", default=str(RESULTS / f"{name}.json"), help="JSON path (PNG written next to it)")
    p.add_argument("--summary-dir", default=str(SUMMARIES),
                   help="folder of the run's summary JSON (bench/README.md's table is made from bench/summaries/)")


def add_cores_args(p: argparse.ArgumentParser, roles: dict[str, tuple[str, str]]) -> None:
    """``--<role>-cores`` for each ``role: (default, what runs there)``: a core list (``0``, ``0,2``,
    ``0-3``; ``''``: not pinned), read with ``bench.common.pinning.parse_cores``."""
    for role, (default, what) in roles.items():
        p.add_argument(f"--{role}-cores", default=default, help=f"cores of {what} ('' : not pinned)")


def add_server_args(p: argparse.ArgumentParser, startup_s: float, request_s: float, server_env: bool = False) -> None:
    """--threads (torch threads of every server), --startup-timeout, --request-timeout, --server-arg
    (repeatable extra flag for every server) and, with ``server_env``, --server-env KEY=VALUE."""
    p.add_argument("--threads", type=int, default=1, help="torch threads of every server")
    p.add_argument("--startup-timeout", type=float, default=startup_s, help="seconds to wait for /health")
    p.add_argument("--request-timeout", type=float, default=request_s, help="seconds per request")
    p.add_argument("--server-arg", action="append", default=[], help="extra flag for every server (repeat)")
    if server_env:
        p.add_argument("--server-env", action="append", default=[],
                       help="KEY=VALUE for the servers' environment (repeat); PYTHONPATH=DIR is prepended")


def resolve_model(args: argparse.Namespace) -> Path:
    """``--model-dir``, else the ``<family>-<size>`` checkpoint in ``--cache-dir``, generated on first use."""
    if args.model_dir:
        return Path(args.model_dir)
    return ensure_model(Path(args.cache_dir) / f"{args.family}-{args.size}", args.family, args.size)


def output_path(args: argparse.Namespace) -> Path:
    """``--out`` as a Path, its folder created."""
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    return out
