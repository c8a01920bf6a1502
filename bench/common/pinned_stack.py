"""A started, healthy ``Stack`` of one mode behind the router (``stages.launch.stack``, what ``stage up``
starts), every thread of every process pinned once it is healthy (``bench.epd_cache``, ``bench.video``)."""

from __future__ import annotations

from argparse import Namespace
from pathlib import Path

from bench.common.pinning import pin_threads


def start_stack(mode: str, args: Namespace, model: Path, log_dir: Path, cores: dict[str, list[int]]):
    """A started, healthy ``Stack`` of ``mode`` behind the router, every process pinned; and its
    pinning record {role: {"pid", "cores"}}. ``args.server_arg`` (where the bench has the flag): more
    flags for every stage."""
    from stages.launch.stack import Stack, StackConfig

    config = StackConfig(model=model, log_dir=log_dir, mode=mode, transfer=args.transfer, threads=args.threads,
                         startup_timeout_s=args.startup_timeout,
                         stage_args=("--log-level", "warning", *getattr(args, "server_arg", ())))
    stack = Stack(config, say=lambda line: print(f"  [{mode}] {line}", flush=True)).start()
    pins = {}
    for child in stack.children:
        pin_threads(child.proc.pid, cores.get(child.spec.role, []))
        pins[child.spec.role] = {"pid": child.proc.pid, "cores": cores.get(child.spec.role) or None,
                                 "url": child.spec.url}
    if stack.redis is not None and stack.redis.process is not None:
        pin_threads(stack.redis.process.pid, cores.get("redis", []))
        pins["redis"] = {"pid": stack.redis.process.pid, "cores": cores.get("redis") or None, "url": stack.redis_url}
    return stack, pins
