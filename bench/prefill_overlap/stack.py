"""A started system behind its router, every process pinned once healthy: ``colocated`` (one server),
``overlap`` or ``no_overlap`` (an embedded Redis, encoder, prefill with or without
``--prefill-overlap``, decode). Stopped in reverse order, Redis last."""

from __future__ import annotations

import sys
from argparse import Namespace
from dataclasses import dataclass, field
from pathlib import Path

from bench.common.children import Child, Server, server_env
from bench.common.pinning import pin_threads
from process.ports import free_port

SYSTEMS = ("colocated", "overlap", "no_overlap")
REDIS_MAXMEMORY = 1 << 30


@dataclass
class System:
    """A started system: its children by role (the router last) and the embedded Redis, if any."""

    name: str
    children: dict[str, Child] = field(default_factory=dict)
    redis: object | None = None  # cache.embedded.EmbeddedRedis

    @property
    def url(self) -> str:
        return self.children["router"].url

    def pins(self) -> dict[str, dict]:
        return {r: {"pid": c.proc.pid, "cores": c.cores or None, "url": c.url, "cmd": c.argv, "log": str(c.log_path)}
                for r, c in self.children.items()}

    def stop(self) -> None:
        for child in reversed(list(self.children.values())):
            child.stop()
        if self.redis is not None:
            self.redis.stop()  # type: ignore[attr-defined]


def start_system(name: str, args: Namespace, model: Path, log_dir: Path, cores: dict[str, list[int]]) -> System:
    """Start ``name``'s processes one after another, each healthy before the next; pin each (every
    thread) to its ``cores`` role entry; stop what started if one fails."""
    if name not in SYSTEMS:
        raise ValueError(f"unknown system {name!r}; choose from {SYSTEMS}")
    log_dir.mkdir(parents=True, exist_ok=True)
    system = System(name)
    try:
        if name == "colocated":
            _add(system, Server("colocated", model, [], args.threads, log_dir / "colocated.log", args.server_arg), args)
            router = ["--colocated", system.children["colocated"].url]
        else:
            from cache.embedded import EmbeddedRedis

            system.redis = redis = EmbeddedRedis(REDIS_MAXMEMORY).start()
            cache = ["--redis-url", redis.url]
            kv = ["--transfer", args.transfer]
            overlap = "--prefill-overlap" if name == "overlap" else "--no-prefill-overlap"
            flags = {"encoder": cache, "prefill": [*cache, *kv, "--bootstrap-port", str(free_port()), overlap],
                     "decode": [*cache, *kv]}
            for role, extra in flags.items():
                _add(system, Server(role, model, [], args.threads, log_dir / f"{role}.log", [*extra, *args.server_arg]),
                     args)
            router = [f for role in flags for f in (f"--{role}", system.children[role].url)] + cache
        port = free_port()
        argv = [sys.executable, "-m", "cli", "serve", "router", "--host", "127.0.0.1", "--port", str(port), *router,
                "--startup-timeout-s", str(args.startup_timeout)]
        _add(system, Child("router", argv, [], log_dir / "router.log", f"http://127.0.0.1:{port}",
                           server_env(1)), args)
        for role, child in system.children.items():
            child.cores = cores.get(role, [])
            pin_threads(child.proc.pid, child.cores)
    except BaseException:
        system.stop()
        raise
    return system


def _add(system: System, child: Child, args: Namespace) -> None:
    system.children[child.name.removesuffix(" server")] = child
    child.wait(args.startup_timeout)
