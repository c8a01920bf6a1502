"""CI's versions of the overload and soak benchmarks (bench/overload/, bench/soak/; the full runs are
by hand, bench/README.md), on real processes: a router in front of a prefill and a decode (KV over
Mooncake) on the tiny model, the stages admitting 4 + 8 requests each.

One stack serves both, one after the other: a 60-second soak at 70% of the capacity its ramp
measured, the processes sampled every 5 s (no growth of RSS or fds past the bounds; threads past
theirs, which follow the requests in flight, must come back within them once the load is gone), then a
burst of 200 concurrent clients (every answer a whole 200 or a 503 with Retry-After, both seen; peak
RSS growth <= 256 MiB per process; all healthy after). Each run's verdict is asserted, and so are
the plots and summary figures the scripts write.
"""

from __future__ import annotations

import time

import httpx
import pytest

from bench.overload.__main__ import build_parser as overload_parser
from bench.overload.procs import usage
from bench.overload.report import figures as overload_figures
from bench.overload.report import plot as overload_plot
from bench.overload.run import run_overload
from bench.overload.stack import start_pd_stack
from bench.soak.__main__ import build_parser as soak_parser
from bench.soak.report import figures as soak_figures
from bench.soak.report import plot as soak_plot
from bench.soak.run import run_soak

pytestmark = pytest.mark.timeout(240)
STACK = ["--max-num-seqs", "4", "--max-waiting", "8", "--router-max-in-flight", "256", "--startup-timeout", "120"]
HOLD_S, SAMPLE_S, CLIENTS = 60.0, 5.0, 200
SETTLE_S = 40.0  # anyio stops a worker thread idle 10 s at the next call into its pool: a few of those


def unsettled_threads(stack, growth: dict[str, dict]) -> dict[str, str]:
    """The processes whose thread count grew past its bound over the hold and is still past it once
    the load is gone: {name: what was seen}. A stage's threads follow its requests in flight (anyio's
    worker threads parse bodies and build prompts, up to its limiter; they stop after 10 s idle, at the
    next call), so on a slow CPU, where requests overlap more as the hold goes on, the count can end
    the hold higher and still be no leak: such a count comes back within the bound of the hold's
    first third. Waits ``SETTLE_S`` at most, sending one short request every 2 s (the next call)."""
    grown = {name: metrics["threads"] for name, metrics in growth.items() if not metrics["threads"]["ok"]}
    seen: dict[str, list[int]] = {name: [] for name in grown}
    deadline = time.monotonic() + SETTLE_S
    with httpx.Client(timeout=30) as client:
        while grown and time.monotonic() < deadline:
            client.post(f"{stack.url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                                  "max_tokens": 1})
            for name, g in list(grown.items()):
                threads = usage(stack.pids()[name])["threads"]
                seen[name].append(threads)
                if threads - g["first"] <= g["bound"]:
                    del grown[name]
            time.sleep(2.0)
    return {name: f"grew {g['growth']} > {g['bound']} over the hold; {seen[name]} after it (first third "
                  f"{g['first']})" for name, g in grown.items()}


@pytest.fixture(scope="module")
def stack(tiny_model, tmp_path_factory):
    args = soak_parser().parse_args(STACK)
    started = start_pd_stack(args, tiny_model("qwen2_vl"), tmp_path_factory.mktemp("soak-logs"))
    yield started
    started.stop()


def test_a_minute_at_seventy_percent_of_capacity_grows_nothing(stack, tmp_path):
    args = soak_parser().parse_args([*STACK, "--duration-s", str(HOLD_S), "--sample-s", str(SAMPLE_S),
                                     "--ramp-step-s", "1.5", "--ramp-concurrency", "1,4,8", "--max-in-flight", "12"])
    report = run_soak(stack, args)
    reasons = report["verdict"]["reasons"]
    assert not [r for r in reasons if " threads: grew " not in r], reasons  # RSS, fds, answers: as judged
    assert unsettled_threads(stack, report["growth"]) == {}, reasons  # threads: no leak, or back in bound
    assert report["capacity_per_s"] > 0 and report["hold"]["target_per_s"] == round(0.7 * report["capacity_per_s"], 3)
    assert HOLD_S <= report["hold"]["duration_s"] < HOLD_S + 30
    assert set(report["verdict"]["outcomes"]["by_status"]) <= {"200", "503"}
    assert len(report["samples"]) >= HOLD_S / SAMPLE_S
    for name in ("router", "prefill", "decode"):
        assert all(report["growth"][name][m]["n"] >= 10 for m in ("rss_mib", "fds", "threads"))
        assert all(report["growth"][name][m]["ok"] for m in ("rss_mib", "fds")), report["growth"][name]
    soak_plot(report, tmp_path / "soak.png", "soak")
    assert (tmp_path / "soak.png").stat().st_size > 10_000
    names = [f.name for f in soak_figures(report)]
    assert names[:5] == ["capacity (ramp, 200s per second)", "hold target rate", "hold achieved rate of 200s",
                         "hold duration", "answers not allowed"] and len(names) == 5 + 9


def test_two_hundred_concurrent_clients_get_only_200s_and_503s_with_retry_after(stack, tmp_path):
    args = overload_parser().parse_args([*STACK, "--clients", str(CLIENTS), "--requests-per-client", "1",
                                         "--deadline-s", "60"])
    report = run_overload(stack, args)
    assert report["verdict"] == {"ok": True, "reasons": []}
    outcomes = report["outcomes"]
    assert outcomes["requests"] == CLIENTS and outcomes["bad_count"] == 0
    assert set(outcomes["by_status"]) == {"200", "503"}, outcomes
    assert outcomes["refusal_codes"] == {"server_overloaded": outcomes["by_status"]["503"]}
    assert set(outcomes["refused_by"]) <= {"prefill", "decode"}, outcomes["refused_by"]  # 200 < --max-in-flight
    assert report["recovered"] == {"router": True, "prefill": True, "decode": True, "request": True}
    assert all(0 <= g["peak_growth_mib"] <= args.max_rss_growth_mib for g in report["rss"].values()), report["rss"]
    overload_plot(report, tmp_path / "overload.png", "overload")
    assert (tmp_path / "overload.png").stat().st_size > 10_000
    figures = {f.name: f.value for f in overload_figures(report)}
    assert figures["requests"] == CLIENTS and figures["answers 429"] == 0 and figures["answers not allowed"] == 0
