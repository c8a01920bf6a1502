"""Shared fixtures: generated tiny models, and real server subprocesses on free loopback ports.

``tiny_model(variant="qwen2_vl") -> Path``   (session scope)
    A random-weight tiny checkpoint of a variant in ``tests.support.generated_models.VARIANTS`` (qwen2_vl,
    qwen2_5_vl, qwen3_vl, llava, llava_siglip_qwen2), built once per machine and generator version.

``start_server(role, *flags, timeout_s=180) -> ServerProcess``   (module scope)
    Runs ``stage serve ROLE *flags --port <free port>`` (a stage server: a fork of a pre-imported
    interpreter, ``tests/support/server_forks.py``; the router, or any with ``EPD_TEST_FRESH_SERVERS=1``: a
    fresh ``python -m cli``), waits
    for /health, and stops it when the module's tests are done. A stage server that runs a model gets ``--device`` from
    ``EPD_TEST_DEVICE`` (tests/support/devices.py) unless ``flags`` name one. ``server.url`` (http://127.0.0.1:PORT), ``server.base_url``
    (``url + "/v1"``, for the openai client), ``server.log()`` (its output so far).

A module starts its server once, in its own module-scoped fixture:

    @pytest.fixture(scope="module")
    def server(start_server, tiny_model):
        return start_server("colocated", "--model", str(tiny_model("qwen2_vl")))
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from process.children import stop_process
from process.instance import INSTANCE_ENV, new_instance_id
from process.ports import free_port
from stages.launch.health import ForeignServer, wait_healthy
from tests.support import server_forks
from tests.support.devices import DEVICE, on_gpu

REPO = Path(__file__).resolve().parents[1]
START_ATTEMPTS = 2  # a free port can be taken between probing it and the server binding it
MODEL_ROLES = ("colocated", "prefill", "decode", "encoder")  # the roles that take --device
KV_ROLES = ("colocated", "prefill", "decode", "pd")  # the roles with a KV pool
# A stage server on a GPU sizes its KV pool from --gpu-memory-utilization (0.9 of the GPU) unless told a size;
# test servers share one GPU, so each gets this fixed pool instead unless its flags name a pool size.
GPU_TEST_KV_CACHE_MIB = "512"


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto`` (pyproject's addopts): one worker more than the cores this process may use, at most
    4. Most of a test's time is spent waiting on servers (deadlines, health, a peer's answer), so a
    core keeps more than one file busy; beyond 4, servers starting at once crowd 2 cores. ``-m unit``
    runs in this process: each worker would import torch and collect the files again, which took
    longer than the unit tests themselves (105 s against 52 s, 2 busy cores)."""
    if config.option.markexpr == "unit":
        return 0
    return min(4, len(os.sched_getaffinity(0)) + 1)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The order xdist hands files to its workers (pyproject turns its own off): files with a ``slow``
    test first (the container image: its build alone takes minutes on one worker), then the rest with
    the fewest tests first. A file of a few tests here is a few real stacks, a minute or more; one of
    many tests is mostly quick unit cases. xdist's own order (most tests first) started the long
    files last, where each ran alone after the others had finished; started first, they overlap the
    short ones, which fill the gaps at the end (per-file times of two whole runs, replayed: 611 s
    and 1121 s instead of xdist's 692 s and 1212 s; the bounds, total / 3 workers, 603 s and 1089 s)."""
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    per_file: dict[Path, int] = {}
    for item in items:
        per_file[item.path] = per_file.get(item.path, 0) + 1
    items.sort(key=lambda item: (item.path not in slow, per_file[item.path]))  # stable: a file's tests keep their order


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """``-m unit``: a test file that marks no test ``unit`` is not imported at all (importing every
    file, servers' and stacks' alike, took longer than running the unit tests)."""
    if config.option.markexpr != "unit" or collection_path.suffix != ".py" or not collection_path.name.startswith("test_"):
        return None
    return "pytest.mark.unit" not in collection_path.read_text() or None


@pytest.fixture(autouse=True)
def unit_stays_in_process(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A test marked ``unit`` (pyproject's markers) that starts a process or listens on a socket fails
    there, so the mark stays true: ``pytest -m unit`` needs no server, and a test that grows one
    loses the mark. Fixtures of a wider scope set up before this one are not watched."""
    if request.node.get_closest_marker("unit") is None:
        return

    def refused(what: str) -> Callable[..., None]:
        def refuse(*args: object, **kwargs: object) -> None:
            raise AssertionError(f"a unit test {what}: drop its unit mark, or keep it in-process")
        return refuse

    monkeypatch.setattr(subprocess.Popen, "__init__", refused("starts a subprocess"))
    monkeypatch.setattr(os, "fork", refused("forks"))
    monkeypatch.setattr(socket.socket, "listen", refused("listens on a socket"))


@pytest.fixture(scope="session")
def tiny_model() -> Callable[[str], Path]:
    from tests.support.generated_models import model_dir

    return lambda variant="qwen2_vl": model_dir(variant, "tiny")


@dataclass
class ServerProcess:
    url: str
    proc: subprocess.Popen | server_forks.ForkedProcess  # the Popen subset: pid, poll, wait, send_signal, kill
    log_path: Path

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        stop_process(self.proc)


def launch(role: str, flags: list[str], log_path: Path, timeout_s: float, env: dict | None = None) -> ServerProcess:
    """Start ``stage serve ROLE`` on a free port and wait until it is healthy (or fail with its log).
    Each try gives the server its own instance id and waits for that id on the port: a free port can be
    drawn by two test processes at once, and both children bind it (``SO_REUSEADDR``, neither listening
    yet); the one that listens second fails, and the other answers on both URLs. Either side of such a
    collision (a foreign instance id, or "address already in use") is tried again on a new port."""
    if role in MODEL_ROLES and "--device" not in flags:
        flags = [*flags, "--device", DEVICE]
    pool_flags = ("--kv-cache-mib", "--gpu-memory-utilization")
    if on_gpu() and role in KV_ROLES and not any(f.split("=")[0] in pool_flags for f in flags):
        flags = [*flags, "--kv-cache-mib", GPU_TEST_KV_CACHE_MIB]
    for attempt in range(START_ATTEMPTS):
        port = free_port()
        argv = ["serve", role, *flags, "--port", str(port)]
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", INSTANCE_ENV: new_instance_id(), **(env or {})}
        if not server_forks.forked(role):
            with open(log_path, "wb") as log_file:
                proc: subprocess.Popen | server_forks.ForkedProcess = subprocess.Popen(
                    [sys.executable, "-m", "cli", *argv], cwd=REPO, stdout=log_file, stderr=subprocess.STDOUT,
                    env=full_env)
        else:
            proc = server_forks.start(argv, log_path, full_env)
        server = ServerProcess(f"http://127.0.0.1:{port}", proc, log_path)
        try:
            wait_healthy(server.url, proc, timeout_s, full_env[INSTANCE_ENV])
            return server
        except (RuntimeError, TimeoutError) as exc:
            server.stop()
            collided = isinstance(exc, ForeignServer) or "address already in use" in server.log().lower()
            if attempt + 1 == START_ATTEMPTS or not collided:
                raise RuntimeError(f"{exc}; server log:\n{server.log()[-4000:]}") from None
    raise AssertionError("unreachable")


@pytest.fixture(scope="module")
def start_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., ServerProcess]]:
    servers: list[ServerProcess] = []
    logs = tmp_path_factory.mktemp("server-logs")

    def start(role: str, *flags: str, timeout_s: float = 180.0, env: dict | None = None) -> ServerProcess:
        server = launch(role, list(flags), logs / f"{role}-{len(servers)}.log", timeout_s, env)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()
