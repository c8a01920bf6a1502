"""``stage bench serve``: flags -> configs, the runs, the summary and the files.

Exit codes: 0 every request completed; 1 the run finished but some requests failed (counted in the
summary, grouped by message); 2 bad flags or an unreadable --workload (one line on stderr);
3 nothing was measured: the model list could not be read from --url, or no request of a run completed.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
from dataclasses import replace
from pathlib import Path

from bench.serve.config import Load, Mix, Slo, Target, parse_rates, parse_size, parse_slo, parse_weighted

EXIT_OK, EXIT_SOME_FAILED, EXIT_USAGE, EXIT_NOTHING_MEASURED = 0, 1, 2, 3
MODELS_TIMEOUT_S = 10.0


def add_args(p: argparse.ArgumentParser) -> None:
    """The flags of ``stage bench serve`` (defaults from the config dataclasses)."""
    mix, load = Mix(), Load()
    g = p.add_argument_group("target")
    g.add_argument("--url", default=None, help="server root, e.g. http://127.0.0.1:8000 (a trailing /v1 is dropped); "
                   "required unless only writing --save-workload")
    g.add_argument("--endpoint", default="/v1/chat/completions", help="chat completions path under --url")
    g.add_argument("--model", default=None, help="model name sent in requests; if it is a directory, its tokenizer "
                   "counts tokens the server did not report and the name comes from the server's /v1/models")
    g.add_argument("--served-model-name", default=None, help="model name sent in requests (overrides --model)")
    g.add_argument("--tokenizer", default=None, help="tokenizer directory for counting tokens when the server sends "
                   "no usage; default: --model if it is a directory, else output tokens = streamed chunks")
    g.add_argument("--request-timeout-s", type=float, default=600.0, help="deadline of one request, send to last byte")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature sent in every request")
    g.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="send ignore_eos (vllm, sglang and stage servers then generate max_tokens tokens)")
    g = p.add_argument_group("load")
    g.add_argument("--num-requests", type=int, default=None, help=f"requests per run; default {mix.num_requests}, "
                   "or with --workload the whole file (N: its first N, repeated if it is shorter)")
    g.add_argument("--request-rate", type=float, default=load.request_rate, help="requests/s (inf: all at once)")
    g.add_argument("--burstiness", type=float, default=load.burstiness,
                   help="gamma shape of the gaps between arrivals: 1 Poisson, < 1 burstier, > 1 more even, "
                   "inf evenly spaced")
    g.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    g.add_argument("--sweep", default=None, help="comma-separated request rates, one run each (replaces --request-rate)")
    g.add_argument("--warmup", type=int, default=1, help="untimed requests sent one at a time before each run")
    g.add_argument("--seed", type=int, default=0, help="seed of the synthetic mix and of the arrivals")
    g = p.add_argument_group("workload")
    g.add_argument("--workload", default=None, help="replay this JSONL workload (format: bench/README.md) instead "
                   "of the synthetic mix")
    g.add_argument("--save-workload", default=None, help="write the synthetic requests to this JSONL file")
    g.add_argument("--images-per-request", default="0:0.3,1:0.5,2:0.2", help="image counts with weights, COUNT:WEIGHT,...")
    g.add_argument("--image-sizes", default="224x224:0.5,448x448:0.5", help="image sizes with weights, WxH:WEIGHT,...")
    g.add_argument("--repeat-image-share", type=float, default=mix.repeat_image_share,
                   help="chance that an image slot resends an image sent before (cache hits)")
    g.add_argument("--input-len", type=int, default=mix.input_len, help="prompt words per request (~tokens)")
    g.add_argument("--output-len", type=int, default=mix.output_len, help="max_tokens per request")
    g.add_argument("--range-ratio", type=float, default=mix.range_ratio,
                   help="lengths drawn uniformly in len * [1 - r, 1 + r]")
    g = p.add_argument_group("output")
    g.add_argument("--slo", default=None, help="goodput objectives in ms: ttft_ms=..,tpot_ms=..,e2el_ms=..")
    g.add_argument("--out", default=None, help="write DIR/result.json and the PNG plots here")
    g.add_argument("--label", default=None, help="a name for this run, kept in the JSON")
    g.add_argument("--summary-dir", default=None,
                   help="with --out: also write the run's summary (bench/README.md, Latest figures) to "
                   "DIR/serve--LABEL.json, LABEL the --label (say there what the server is), when every request "
                   "completed; e.g. bench/summaries")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    """Run ``stage bench serve`` (see the module docstring for the exit codes)."""
    missing = [name for name in ("tqdm", *(("matplotlib",) if args.out else ())) if importlib.util.find_spec(name) is None]
    if missing:
        return _fail(EXIT_USAGE, f"missing {', '.join(missing)}: pip install 'epd-stage[bench]'")
    try:
        if args.summary_dir and not (args.out and args.label):
            raise ValueError("--summary-dir needs --out (the full results) and --label (what the server is)")
        mix, load, slo, rates = _configs(args)
        requests = _requests(args, mix)
    except ValueError as exc:
        return _fail(EXIT_USAGE, str(exc))
    if args.save_workload:
        from bench.serve.workload import write_jsonl

        write_jsonl(Path(args.save_workload), requests)
        print(f"wrote {len(requests)} requests to {args.save_workload}")
    if args.url is None:
        return EXIT_OK if args.save_workload else _fail(EXIT_USAGE, "--url is required")
    url = args.url.rstrip("/").removesuffix("/v1")
    model = args.served_model_name or (args.model if args.model and not Path(args.model).is_dir() else None)
    if model is None:
        try:
            model = first_model(url)
        except RuntimeError as exc:
            return _fail(EXIT_NOTHING_MEASURED, f"{exc}; is the server up at --url? (or pass --served-model-name)")
    try:
        target = Target(url, model, args.endpoint, args.request_timeout_s, args.temperature, args.ignore_eos)
    except ValueError as exc:
        return _fail(EXIT_USAGE, str(exc))
    tokenizer = args.tokenizer or (args.model if args.model and Path(args.model).is_dir() else None)
    record = _recorder(args) if args.summary_dir else None
    try:
        results = [run_once(requests, target, replace(load, request_rate=rate), slo, args, tokenizer)
                   for rate in rates]
    except ValueError as exc:  # a --tokenizer that cannot be loaded
        return _fail(EXIT_USAGE, str(exc))
    code = (EXIT_NOTHING_MEASURED if any(r["completed"] == 0 for r, _ in results) else
            EXIT_SOME_FAILED if any(r["failed"] for r, _ in results) else EXIT_OK)
    if args.out:
        _write(Path(args.out), results, args, record if code == EXIT_OK else None)
    return code


def run_once(requests: list, target: Target, load: Load, slo: Slo, args: argparse.Namespace,
             tokenizer: str | None) -> tuple[dict, dict]:
    """One run at ``load``: send, count tokens, summarize, print. Returns (result dict, latency samples)."""
    import asyncio
    from datetime import datetime

    from bench.serve import metrics, runner, tokens, workload
    from bench.serve.report import summary

    rate = "inf" if math.isinf(load.request_rate) else load.request_rate
    done = asyncio.run(runner.run(runner.payloads(requests, target), target, load, warmup=args.warmup,
                                  progress=not args.no_progress, label=f"rate {rate}"))
    counts = tokens.count(done.outcomes, requests, tokenizer)
    result = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"), "backend": "openai-chat", "endpoint_type": "openai-chat",
        "label": args.label, "model_id": target.model, "tokenizer_id": tokenizer, "num_prompts": len(requests),
        "request_rate": rate, "burstiness": load.burstiness, "max_concurrency": load.max_concurrency,
        **metrics.summarize(done.outcomes, counts, done.duration, slo),
        "client_cpu_s": round(done.client_cpu_s, 3),
        "client_cpu_share": round(done.client_cpu_s / done.duration, 3) if done.duration > 0 else None,
        "warmup": args.warmup, "url": target.chat_url, "workload": workload.summarize(requests),
    }
    print(summary(result), flush=True)
    return result, metrics.per_request(done.outcomes, counts)


def first_model(url: str) -> str:
    """The first model id of ``url``/v1/models; RuntimeError says why there is none."""
    import json
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"{url}/v1/models", timeout=MODELS_TIMEOUT_S) as response:
            data = json.loads(response.read())
        return data["data"][0]["id"]
    except urllib.error.HTTPError as exc:
        raise RuntimeError(f"GET {url}/v1/models answered HTTP {exc.code}") from None
    except urllib.error.URLError as exc:
        raise RuntimeError(f"cannot reach {url}/v1/models: {getattr(exc.reason, 'strerror', None) or exc.reason}") from None
    except (OSError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise RuntimeError(f"no model id in {url}/v1/models ({type(exc).__name__}: {exc})") from None


def _configs(args: argparse.Namespace):
    count = Mix().num_requests if args.num_requests is None else args.num_requests
    mix = Mix(num_requests=count, images_per_request=parse_weighted("--images-per-request", args.images_per_request, int),
              image_sizes=parse_weighted("--image-sizes", args.image_sizes, parse_size),
              repeat_image_share=args.repeat_image_share, input_len=args.input_len, output_len=args.output_len,
              range_ratio=args.range_ratio, seed=args.seed)
    load = Load(args.request_rate, args.burstiness, args.max_concurrency, args.seed)
    rates = parse_rates(args.sweep) if args.sweep else (args.request_rate,)
    for rate in rates:  # each must make a valid Load
        replace(load, request_rate=rate)
    if args.warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {args.warmup}")
    return mix, load, parse_slo(args.slo), rates


def _requests(args: argparse.Namespace, mix: Mix) -> list:
    from bench.serve.workload import read_jsonl, synthesize

    if not args.workload:
        return synthesize(mix)
    if args.save_workload:
        raise ValueError("--save-workload records the synthetic mix; it cannot be used with --workload")
    requests = read_jsonl(Path(args.workload))
    if args.num_requests is not None:
        requests = [requests[i % len(requests)] for i in range(args.num_requests)]
    return requests


def _recorder(args: argparse.Namespace):  # -> bench.common.record.Recorder
    """The run's recorder: its configuration is ``--label``, its summary ``serve--<label>.json``."""
    import shlex

    from bench.common.record import Recorder

    return Recorder("serve", args.label, shlex.join(["stage", *sys.argv[1:]]), Path(args.summary_dir))


def _write(out: Path, results: list[tuple[dict, dict]], args: argparse.Namespace, record) -> None:
    """result.json (one run's dict, or a sweep's runs) with the machine, the plots, and with ``record``
    the summary too."""
    from bench.serve import plots
    from bench.serve.report import figures
    from bench.common.machine import machine_info
    from bench.common.output import write_json

    machine = machine_info()
    model = results[0][0]["model_id"]
    runs = [r for r, _ in results]
    report = {**runs[0], "machine": machine} if len(results) == 1 else {"label": args.label, "machine": machine,
                                                                          "runs": runs}
    if record is None:
        write_json(out / "result.json", report)
    else:
        print(f"wrote the summary {record.finish(out / 'result.json', report, figures(runs))}")
    if len(results) > 1:
        plots.latency_vs_rate(runs, out / "latency_vs_rate.png", f"{model}: latency vs request rate")
    plots.latency_cdfs([(f"rate {r['request_rate']}", samples) for r, samples in results], out / "latency_cdf.png",
                       f"{model}: latency CDFs ({results[0][0]['num_prompts']} requests per run)")
    print(f"wrote {out / 'result.json'} and the plots in {out}")


def _fail(code: int, message: str) -> int:
    print(f"stage bench serve: error: {message}", file=sys.stderr)
    return code
