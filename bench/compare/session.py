"""One deployment in one round of a compare run: start its ``stage up`` stack behind the router, pin it,
warm it up, drive it with every workload in turn (``bench.serve``'s runner, one run each), stop it.

Called by ``cli.py`` once per deployment and round, one after the other; ``requests`` are the same
objects for every deployment; ``pool.py`` pools the rounds. This process (the client) is pinned to
the client's cores while it measures and unpinned while a stack starts (the stack's children inherit
this process's affinity until ``pin_stack``; a model loads faster on every core)."""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import Callable

from bench.compare.config import CompareConfig, Workload
from bench.compare.pinning import pin_stack
from bench.compare.probe import Probe
from bench.compare.pool import Measured
from bench.serve import runner, tokens
from bench.serve.cli import first_model
from bench.serve.config import Load, Mix, Target
from bench.serve.workload import Request, synthesize
from stages.launch.stack import Stack, StackConfig

WARMUP_SEED = 999_983  # its own images: none of them is in a workload


def warmup_requests() -> list[Request]:
    """Three untimed requests, one after the other: text only, one image, three images (224x224)."""
    return [request for count in (0, 1, 3) for request in synthesize(
        Mix(num_requests=1, images_per_request=((count, 1.0),), image_sizes=(((224, 224), 1.0),), input_len=16,
            output_len=4, seed=WARMUP_SEED + count))]


def run_deployment(config: CompareConfig, mode: str, requests: dict[str, list[Request]], cores: set[int],
                   say: Callable[[str], None]) -> dict:
    """Start ``mode``'s stack, measure every workload, stop it. ``cores``: this process's affinity at
    the start of the run (restored here at the end). Returns {"placed", "urls", "workloads": name ->
    ``Measured``}. Raises
    ``stages.launch.stack.StackError`` if the stack cannot start (everything started is stopped first)."""
    log_dir = config.out / "logs" / mode
    shutil.rmtree(log_dir, ignore_errors=True)
    stack_config = StackConfig(model=config.model, log_dir=log_dir, mode=mode, transfer=config.transfer,
                               threads=config.threads, startup_timeout_s=config.startup_timeout_s)
    os.sched_setaffinity(0, cores)
    try:
        return _measure(Stack(stack_config, say=say), config, mode, requests, say)
    finally:
        os.sched_setaffinity(0, cores)


def _measure(stack: Stack, config: CompareConfig, mode: str, requests: dict[str, list[Request]],
             say: Callable[[str], None]) -> dict:
    with stack:
        placed = pin_stack(stack, config.pinning)
        os.sched_setaffinity(0, config.pinning.of("client"))
        urls = {role: url for role, url in stack.urls().items() if role != "redis"}
        target = Target(stack.url, first_model(stack.url), request_timeout_s=config.request_timeout_s)
        warm = _drive(warmup_requests(), target, Load(max_concurrency=1), config, f"{mode} warm-up")
        if not all(o.ok for o in warm.outcomes):
            say(f"warm-up: {sum(not o.ok for o in warm.outcomes)} of {len(warm.outcomes)} requests failed: "
                f"{next(o.error for o in warm.outcomes if not o.ok)}")
        out: dict = {"placed": placed, "urls": stack.urls(), "workloads": {}}
        pids = {role: group["pids"] for role, group in placed.items()}
        for workload in config.workloads:
            measured = run_workload(workload, requests[workload.name], target, urls, pids, config, mode)
            out["workloads"][workload.name] = measured
            failed = sum(not o.ok for o in measured.outcomes)
            say(f"{mode} {workload.name}: {len(measured.outcomes) - failed} completed, {failed} failed in "
                f"{measured.duration:.1f} s")
    return out


def run_workload(workload: Workload, requests: list[Request], target: Target, urls: dict[str, str],
                 pids: dict[str, list[int]], config: CompareConfig, mode: str) -> Measured:
    """One workload against a running stack: what the client saw, the token counts (the servers'
    usage) and the probe (each role's busy seconds, counters and CPU over the run; the machine's meters)."""
    probe = Probe(urls, pids)
    run = _drive(requests, target, workload.load, config, f"{mode} {workload.name}")
    probed = probe.done()
    return Measured(run.outcomes, tokens.count(run.outcomes, requests, str(config.model)), run.duration,
                    run.client_cpu_s, probed)


def _drive(requests: list[Request], target: Target, load: Load, config: CompareConfig, label: str) -> runner.Run:
    return asyncio.run(runner.run(runner.payloads(requests, target), target, load, warmup=0,
                                  progress=config.progress, label=label))
