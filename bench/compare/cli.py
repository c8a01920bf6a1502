"""``stage bench compare``: flags -> CompareConfig; each deployment in turn; the table, JSON, plots.

Exit codes: 0 every request of every deployment completed; 1 the run finished but some requests
failed (counted per workload, grouped by message in the JSON); 2 bad flags (one line on stderr);
3 a deployment could not start in some round (its errors are in the JSON; the rest still ran) or a
workload completed nothing.

Output in ``--out`` (default ``bench/results/compare``): ``compare.json``, ``compare.md`` (the table as
Markdown), ``compare.png``, ``compare_cdf_<workload>.png``, ``logs/<deployment>/<role>.log``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from bench.common.args import SUMMARIES
from bench.compare.config import (DEPLOYMENTS, PIN_ROLES, WORKLOAD_NAMES, CompareConfig, Pinning, Sizing, select,
                                  workloads)
from bench.serve.config import parse_size, parse_slo

EXIT_OK, EXIT_SOME_FAILED, EXIT_USAGE, EXIT_NOT_MEASURED = 0, 1, 2, 3
DEFAULT_OUT = Path(__file__).resolve().parents[1] / "results" / "compare"


def add_args(p: argparse.ArgumentParser) -> None:
    """The flags of ``stage bench compare`` (defaults from the config dataclasses)."""
    sizing, config = Sizing(), CompareConfig(model=Path(), out=Path())
    g = p.add_argument_group("model and deployments")
    g.add_argument("--model", default=None, help="checkpoint directory; default: the generated --family model "
                   "of --size")
    g.add_argument("--family", default="qwen2_vl", help="model family to generate (without --model)")
    g.add_argument("--size", default="small", help="model size to generate (without --model)")
    g.add_argument("--deployments", default=",".join(DEPLOYMENTS), help="which of colocated,pd,epd (colocated is "
                   "required: the ratios are against it); run in that order")
    g.add_argument("--transfer", default=config.transfer, help="KV transfer of pd and epd (mooncake, nixl)")
    g.add_argument("--threads", type=int, default=config.threads, help="torch threads of every stage server")
    g.add_argument("--rounds", type=int, default=config.rounds, help="run the deployments this many times, "
                   "reversed every other round, and pool each one's samples (outside load drifts over a run)")
    g.add_argument("--pin", action="append", default=[], metavar="ROLE=CORES",
                   help=f"cores of one role, e.g. --pin decode=1 or --pin prefill=0-1 (roles: {', '.join(PIN_ROLES)}; "
                   "client is this process); default split: bench/README.md")
    g = p.add_argument_group("workloads")
    g.add_argument("--workloads", default=",".join(WORKLOAD_NAMES), help="which workloads, run in this order")
    g.add_argument("--num-requests", type=int, default=sizing.num_requests, help="requests per loaded workload")
    g.add_argument("--single-requests", type=int, default=sizing.single_requests,
                   help="requests of the single workload (one at a time)")
    g.add_argument("--output-len", type=int, default=sizing.output_len, help="max_tokens of every request")
    g.add_argument("--image-size", default="x".join(map(str, sizing.image_size)), help="WxH of every image")
    g.add_argument("--rates", default=",".join(f"{k}={v:g}" for k, v in sizing.rates),
                   help="Poisson request rate (req/s) of each loaded workload, NAME=RATE,...")
    g.add_argument("--seed", type=int, default=sizing.seed, help="seed of the workloads and the arrivals")
    g = p.add_argument_group("measurement and output")
    g.add_argument("--slo", default=",".join(f"{k}={v:g}" for k, v in config.slo.given().items()),
                   help="goodput objectives in ms: ttft_ms=..,tpot_ms=..,e2el_ms=..")
    g.add_argument("--request-timeout-s", type=float, default=config.request_timeout_s,
                   help="deadline of one request, send to last byte")
    g.add_argument("--startup-timeout-s", type=float, default=config.startup_timeout_s,
                   help="every process of a deployment must be healthy within this")
    g.add_argument("--out", default=str(DEFAULT_OUT), help="folder for compare.json, compare.md, the plots, the logs")
    g.add_argument("--summary-dir", default=str(SUMMARIES),
                   help="folder of the run's summary JSON (bench/README.md's table is made from bench/summaries/)")
    g.add_argument("--no-progress", action="store_true", help="no progress bars")


def run(args: argparse.Namespace) -> int:
    """Run ``stage bench compare`` (see the module docstring for the exit codes)."""
    import importlib.util

    missing = [name for name in ("tqdm", "matplotlib") if importlib.util.find_spec(name) is None]
    if missing:
        return _fail(EXIT_USAGE, f"missing {', '.join(missing)}: pip install 'epd-stage[bench]'")
    allowed = os.sched_getaffinity(0)
    try:
        config = build_config(args, Path(args.model or "."))
        if args.model is not None and not (config.model / "config.json").exists():
            raise ValueError(f"--model {args.model} is not a checkpoint directory (no config.json)")
        unavailable = sorted(config.pinning.all_cores() - allowed)
        if unavailable:
            raise ValueError(f"--pin: core {', '.join(map(str, unavailable))} is not available to this process "
                             f"(available: {', '.join(map(str, sorted(allowed)))})")
    except ValueError as exc:
        return _fail(EXIT_USAGE, str(exc))
    if args.model is None:
        from dataclasses import replace

        from stages.launch.models import cache_dir, ensure_model

        config = replace(config, model=ensure_model(cache_dir() / f"{args.family}-{args.size}", args.family, args.size))
    return measure(config, allowed, _recorder(args))


def _recorder(args: argparse.Namespace):  # -> bench.common.record.Recorder
    """The run's recorder: its configuration is the flags that differ from their defaults (output,
    progress and timeouts aside), its summary ``compare[--CONFIG].json`` in ``--summary-dir``."""
    import shlex

    from bench.common.record import NOT_CONFIGURATION, Recorder, configuration

    parser = argparse.ArgumentParser()
    add_args(parser)
    defaults = vars(parser.parse_args([]))
    ignore = NOT_CONFIGURATION | {"no_progress", "request_timeout_s", "startup_timeout_s"}
    config = configuration(defaults, {name: getattr(args, name) for name in defaults}, ignore)
    return Recorder("compare", config, shlex.join(["stage", *sys.argv[1:]]), Path(args.summary_dir))


def build_config(args: argparse.Namespace, model: Path) -> CompareConfig:
    """The validated config of a command line; ValueError names the flag to change."""
    rates = tuple((name, _number("--rates", name, value)) for name, value in _pairs("--rates", args.rates))
    try:
        image_size = parse_size(args.image_size)
    except ValueError:
        raise ValueError(f"--image-size: expected WxH, e.g. 448x448, got {args.image_size!r}") from None
    sizing = Sizing(num_requests=args.num_requests, single_requests=args.single_requests, output_len=args.output_len,
                    image_size=image_size, rates=rates, seed=args.seed)
    names = tuple(name.strip() for name in args.workloads.split(",") if name.strip())
    wanted = tuple(name.strip() for name in args.deployments.split(",") if name.strip())
    deployments = tuple(d for d in DEPLOYMENTS if d in wanted) + tuple(d for d in wanted if d not in DEPLOYMENTS)
    return CompareConfig(model=model, out=Path(args.out), deployments=deployments,
                         workloads=select(workloads(sizing), names), slo=parse_slo(args.slo),
                         pinning=Pinning().overridden(dict(_pin(item) for item in args.pin)), transfer=args.transfer,
                         threads=args.threads, rounds=args.rounds, request_timeout_s=args.request_timeout_s,
                         startup_timeout_s=args.startup_timeout_s, progress=not args.no_progress)


def measure(config: CompareConfig, allowed: set[int], record) -> int:
    """Every round of every deployment, then the pooling, the analysis, the printed table and the files;
    the summary (``record``) only when every request of every deployment completed."""
    from bench.compare import analysis, plots, report as text
    from bench.compare.session import run_deployment
    from bench.serve.workload import synthesize
    from stages.launch.stack import StackError

    say = lambda line: print(f"compare: {line}", flush=True)  # noqa: E731
    say(f"model {config.model}; deployments {', '.join(config.deployments)}; {config.rounds} round(s); cores "
        + ", ".join(f"{role} {'+'.join(map(str, cores))}" for role, cores in config.pinning.cores))
    requests = {w.name: synthesize(w.mix) for w in config.workloads}
    rounds: dict[str, list[dict]] = {mode: [] for mode in config.deployments}
    errors: dict[str, list[str]] = {mode: [] for mode in config.deployments}
    for index in range(config.rounds):
        for mode in config.order(index):
            say(f"round {index + 1} of {config.rounds}: {mode}")
            try:
                rounds[mode].append(run_deployment(config, mode, requests, allowed, say))
            except StackError as exc:
                say(f"{mode} could not start: {exc}")
                errors[mode].append(str(exc))
    deployments, samples = pool_rounds(config, rounds, errors, requests)
    report = build_report(config, deployments, analysis)
    out = config.out
    code = exit_code(report)
    summary = record.finish(out / "compare.json", report, text.figures(report) if code == EXIT_OK else None)
    (out / "compare.md").write_text(text.markdown(report))
    print("\n".join(["", text.table(report), "", text.work_text(report), "", text.goals_text(report)]), flush=True)
    plots.bars(report, out / "compare.png")
    plots.cdfs(report, samples, out)
    say(f"wrote {out / 'compare.json'}, compare.md and the plots in {out}"
        + (f"; the summary {summary}" if summary else "; no summary (a deployment or request failed)"))
    return code


def pool_rounds(config: CompareConfig, rounds: dict[str, list[dict]], errors: dict[str, list[str]],
                requests: dict) -> tuple[dict[str, dict], dict[str, dict]]:
    """Per deployment: its start errors, and for the rounds it ran, the placement and each workload's
    pooled result (``pool.pooled``); and the pooled latency samples per deployment and workload."""
    from bench.compare.pool import pooled

    deployments: dict[str, dict] = {}
    samples: dict[str, dict] = {}
    for mode in config.deployments:
        done = rounds[mode]
        deployments[mode] = {"errors": errors[mode]} if errors[mode] else {}
        if not done:
            continue
        pooled_runs = {w.name: pooled([r["workloads"][w.name] for r in done], config.slo, requests[w.name])
                       for w in config.workloads}
        deployments[mode].update(placed=done[-1]["placed"], rounds=len(done),
                                 workloads={name: result for name, (result, _) in pooled_runs.items()})
        samples[mode] = {name: s for name, (_, s) in pooled_runs.items()}
    return deployments, samples


def build_report(config: CompareConfig, deployments: dict[str, dict], analysis) -> dict:
    """The JSON: machine, config (with the pinning), each deployment's results, ratios, work, goals."""
    import math
    from datetime import datetime

    from bench.common.machine import loadavg, machine_info

    measured = {mode: d for mode, d in deployments.items() if "workloads" in d}
    client = config.pinning.of("client")
    has_base = "colocated" in measured
    work = analysis.all_stage_work(measured, client)
    return {
        "date": datetime.now().strftime("%Y-%m-%d %H:%M:%S"),
        "machine": {**machine_info(), "loadavg_1m_end": loadavg()},
        "config": {
            "model": str(config.model), "model_name": config.model.name, "deployments": list(config.deployments),
            "workloads": [{"name": w.name, "what": w.what, "num_requests": w.mix.num_requests,
                           "request_rate": "inf" if math.isinf(w.load.request_rate) else w.load.request_rate,
                           "max_concurrency": w.load.max_concurrency} for w in config.workloads],
            "slo": config.slo.given(), "pinning": {role: list(cores) for role, cores in config.pinning.cores},
            "transfer": config.transfer, "threads": config.threads, "rounds": config.rounds,
            "request_timeout_s": config.request_timeout_s},
        "deployments": deployments,
        "ratios": analysis.ratios(measured) if has_base else {},
        "stage_work": work,
        "goals": analysis.goals(measured, work) if has_base else [],
    }


def exit_code(report: dict) -> int:
    """3 if a deployment did not start (in any round) or a workload completed nothing; else 1 if any
    request failed."""
    results = [r for d in report["deployments"].values() for r in d.get("workloads", {}).values()]
    if any(d.get("errors") or "workloads" not in d for d in report["deployments"].values()) \
            or any(r["completed"] == 0 for r in results):
        return EXIT_NOT_MEASURED
    return EXIT_SOME_FAILED if any(r["failed"] for r in results) else EXIT_OK


def _pairs(flag: str, text: str) -> list[tuple[str, str]]:
    out = []
    for part in text.split(","):
        if part.strip():
            key, sep, value = part.partition("=")
            if not sep:
                raise ValueError(f"{flag}: cannot read {part.strip()!r} (expected NAME=VALUE)")
            out.append((key.strip(), value.strip()))
    return out


def _number(flag: str, name: str, value: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"{flag}: {name} must be a number, got {value!r}") from None


def _pin(item: str) -> tuple[str, tuple[int, ...]]:
    """``ROLE=CORES`` (``bench.common.pinning.parse_cores``: 1, 0,2 or 0-3) -> (role, cores)."""
    from bench.common.pinning import parse_cores

    role, sep, cores = item.partition("=")
    try:
        parsed = tuple(parse_cores(cores)) if sep else ()
    except ValueError:
        parsed = ()
    if not parsed:
        raise ValueError(f"--pin: cannot read {item!r} (expected ROLE=CORES, e.g. decode=1 or prefill=0-1)")
    return role.strip(), parsed


def _fail(code: int, message: str) -> int:
    print(f"stage bench compare: error: {message}", file=sys.stderr)
    return code
