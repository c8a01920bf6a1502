"""The printed summary of a run (the layout of ``vllm bench serve``'s, plus failures grouped by message
and how tokens were counted), and the figures of a run's summary. Pure."""

from __future__ import annotations

from bench.common.record import Figure


HEADERS = {"ttft": ("TTFT", "Time to First Token"), "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
           "itl": ("ITL", "Inter-token Latency"), "e2el": ("E2EL", "End-to-end Latency")}
MAX_REASONS = 10  # failure messages printed (all are in the JSON)
CLIENT_BUSY_SHARE = 0.8  # client CPU / duration above this: the client may have set the pace
CLIENT_BUSY_MIN_S = 1.0  # ... over a run at least this long (a shorter one is mostly start-up)


def summary(result: dict) -> str:
    """The summary block of one run's result (``cli.run_once``'s dict)."""
    lines = [" Serving Benchmark Result ".center(50, "=")]

    def row(label: str, value: object, fmt: str = "") -> None:
        text = "n/a" if value is None else format(value, fmt)
        lines.append(f"{label:<40} {text}")

    row("Successful requests:", result["completed"])
    row("Failed requests:", result["failed"])
    row("Request rate configured (RPS):", result["request_rate"])
    row("Burstiness factor:", result["burstiness"])
    row("Maximum request concurrency:", result["max_concurrency"])
    row("Benchmark duration (s):", result["duration"], ".2f")
    row("Total input tokens:", result["total_input_tokens"])
    row("Total generated tokens:", result["total_output_tokens"])
    row("Request throughput (req/s):", result["request_throughput"], ".2f")
    row("Output token throughput (tok/s):", result["output_throughput"], ".2f")
    row("Total token throughput (tok/s):", result["total_token_throughput"], ".2f")
    if result["slo"]:
        slo = ", ".join(f"{k}<={v:g}" for k, v in result["slo"].items())
        row(f"Request goodput (req/s) [{slo}]:", result["request_goodput"], ".2f")
        row("Good requests:", f"{result['good_requests']} of {result['completed'] + result['failed']}")
    for name, (short, header) in HEADERS.items():
        lines.append(f"{header:-^50}")
        for stat, label in (("mean", "Mean"), ("median", "Median"), ("p90", "P90"), ("p99", "P99")):
            row(f"{label} {short} (ms):", result[f"{stat}_{name}_ms"], ".2f")
    lines += notes(result)
    if result["failure_reasons"]:
        lines.append(f"{' Failures (by message) ':-^50}")
        reasons = list(result["failure_reasons"].items())
        lines += [f"{count:>6} x {message}" for message, count in reasons[:MAX_REASONS]]
        if len(reasons) > MAX_REASONS:
            lines.append(f"   ... {len(reasons) - MAX_REASONS} more messages in the JSON (failure_reasons)")
    if result["completed"] == 0:
        lines.append("no request completed: nothing was measured")
    lines.append("=" * 50)
    return "\n".join(lines)


def notes(result: dict) -> list[str]:
    """Lines about how tokens were counted, and a warning when the client was busy."""
    out = []
    output_sources = result["token_counts"].get("output", {})
    if set(output_sources) - {"usage"}:
        how = ", ".join(f"{n} by {source}" for source, n in output_sources.items())
        out.append(f"note: the server sent no usage for some answers; output tokens counted: {how}")
        if "chunks" in output_sources:
            out.append("note: counted as one token per streamed chunk (pass --tokenizer DIR to count them exactly)")
    input_sources = result["token_counts"].get("input", {})
    if set(input_sources) - {"usage"}:
        out.append("note: prompt tokens without usage: "
                   + ", ".join(f"{n} {source}" for source, n in input_sources.items()))
    share = result.get("client_cpu_share")
    if share is not None and share > CLIENT_BUSY_SHARE and result["duration"] >= CLIENT_BUSY_MIN_S:
        out.append(f"warning: the client used {share:.0%} of a core: it may have been the bottleneck")
    return out


FIGURES = (("median_ttft_ms", "TTFT p50", "ms"), ("p99_ttft_ms", "TTFT p99", "ms"), ("median_tpot_ms", "TPOT p50", "ms"),
           ("p99_tpot_ms", "TPOT p99", "ms"), ("median_e2el_ms", "E2E p50", "ms"),
           ("request_throughput", "requests", "req/s"), ("output_throughput", "output tokens", "tok/s"),
           ("request_goodput", "goodput", "req/s"))


def figures(runs: list[dict]) -> list[Figure]:
    """Per run (its request rate named when there are several): TTFT, TPOT and E2E percentiles,
    throughput and, with --slo, goodput."""
    out = []
    for run in runs:
        where = f"rate {run['request_rate']}: " if len(runs) > 1 else ""
        out += [Figure(f"{where}{name}", run[key], unit) for key, name, unit in FIGURES
                if key != "request_goodput" or run.get("slo")]
    return out
