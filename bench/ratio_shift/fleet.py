"""The fleet of the whole run: an embedded Redis and N switchable EPD workers (``stage serve pd
--redis-url``), started once; per configuration a router whose role flags give the starting split,
Redis flushed before it starts."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.common.children import Child, Server, server_env
from process.ports import free_port

TOKEN = "ratio-shift-bench-admin-token-0001"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
ROLE_FLAGS = {"encoder": "--encoder", "prefill": "--prefill", "decode": "--decode"}


class Fleet:
    """Redis and ``workers`` switchable workers of ``model``, each with ``threads`` torch threads and
    its own bootstrap port, logs in ``log_dir``; ``flags``: more flags for every worker."""

    def __init__(self, model: Path, workers: int, threads: int, log_dir: Path, flags: Sequence[str] = ()) -> None:
        from cache.config import MIB
        from cache.embedded import EmbeddedRedis

        log_dir.mkdir(parents=True, exist_ok=True)
        self.model, self.log_dir = model, log_dir
        self.redis = EmbeddedRedis(512 * MIB).start()
        worker_flags = ["--redis-url", self.redis.url, "--admin-token", TOKEN, "--transfer", "mooncake", *flags]
        self.workers = [Server("pd", model, (), threads, log_dir / f"worker{i}.log",
                               [*worker_flags, "--bootstrap-port", str(free_port())]) for i in range(workers)]
        self.router: Child | None = None

    def wait(self, timeout_s: float) -> None:
        with ThreadPoolExecutor(len(self.workers)) as pool:
            list(pool.map(lambda w: w.wait(timeout_s), self.workers))

    def flush(self) -> None:
        """FLUSHALL: no configuration reuses another's embeddings."""
        import redis

        client = redis.Redis.from_url(self.redis.url)
        try:
            client.flushall()
        finally:
            client.close()

    def start_router(self, split: dict[str, int], flags: Sequence[str], name: str, timeout_s: float) -> Child:
        """A router over every worker, the first ``split["encoder"]`` given as encoders, the next as
        prefills, the rest as decodes, with ``flags``; healthy."""
        urls = iter(w.url for w in self.workers)
        roles = [f for role, n in split.items() for f in [ROLE_FLAGS[role], ""] * n]
        argv = [flag if i % 2 == 0 else next(urls) for i, flag in enumerate(roles)]
        port = free_port()
        self.router = Child(f"router ({name})", [sys.executable, "-m", "cli", "serve", "router", "--port", str(port),
                                                  *argv, "--redis-url", self.redis.url, "--admin-token", TOKEN,
                                                  "--log-level", "info", *flags],
                            (), self.log_dir / f"router_{name}.log", f"http://127.0.0.1:{port}", server_env(1))
        self.router.wait(timeout_s)
        return self.router

    def stop_router(self) -> None:
        if self.router is not None:
            self.router.stop()
            self.router = None

    def stop(self) -> None:
        self.stop_router()
        for worker in self.workers:
            worker.stop()
        self.redis.stop()

