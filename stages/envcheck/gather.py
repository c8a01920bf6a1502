"""Reads ``stage env``'s facts off this machine. Every probe catches its own failure and reports it as a
fact, so ``gather_facts`` never raises for what the machine lacks.

    gather_facts(redis_url, redis_timeout_s=1.0) -> Facts

torch is imported here (its GPUs: names, free memory). Mooncake and NIXL are imported only in child
processes (``python -c "import ..."``): "does it import" is a fact users need (Mooncake's import fails
without libibverbs), a failing native import must not take this process down, and Mooncake's glog
lines stay out of the report. Which builds are installed and whether they can register GPU memory
comes from their metadata (``transfer.builds``). The children and UCX's query run at once.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
import re
import shutil
import subprocess
import sys
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from stages.envcheck.facts import Backend, Facts, Gpu, RedisFacts, TorchFacts, UcxFacts, safe_url
from stages.envcheck.ucx_probe import ucx_transports
from transfer.builds import installed_mooncake, installed_nixl, mooncake_gpu_capable, nixl_gpu_capable, torch_build

IMPORTS = {"mooncake": "import mooncake.engine", "nixl": "import nixl._bindings"}  # what transfer/*.py import
IMPORT_TIMEOUT_S = 60.0
INFINIBAND = Path("/sys/class/infiniband")


def gather_facts(redis_url: str | None, redis_timeout_s: float = 1.0) -> Facts:
    """Everything ``stage env`` reports; ``redis_url`` (password included) is PINGed when given."""
    with ThreadPoolExecutor(max_workers=3) as pool:
        imports = {name: pool.submit(import_error, statement) for name, statement in IMPORTS.items()}
        torch = torch_facts()  # meanwhile
        ucx = pool.submit(ucx_facts, torch.build)
        backends = (mooncake_facts(imports["mooncake"].result()), nixl_facts(imports["nixl"].result(), torch.build))
        return Facts(python=sys.version.split()[0], platform=platform.platform(), torch=torch,
                     transformers=version("transformers"), backends=backends, ucx=ucx.result(), rdma=rdma_devices(),
                     redis=redis_facts(redis_url, redis_timeout_s), stage=version("epd-stage"))


def version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".splitlines()[0]


def torch_facts() -> TorchFacts:
    try:
        import torch
    except Exception as exc:  # noqa: BLE001 - an OSError of a missing CUDA library as much as an ImportError
        return TorchFacts(version=None, error=one_line(exc))
    cuda = torch.version.cuda
    try:
        build, build_error = torch_build(cuda), None
    except ValueError as exc:
        build, build_error = None, str(exc)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        available = torch.cuda.is_available()
    reason = None
    if not available and cuda:
        reason = str(caught[0].message).splitlines()[0] if caught else "torch.cuda.is_available() is False"
    gpus = tuple(_gpu(torch, index) for index in range(torch.cuda.device_count())) if available else ()
    return TorchFacts(version=torch.__version__, cuda=cuda, build=build, build_error=build_error, cuda_reason=reason,
                      gpus=gpus, driver=driver_version())


def _gpu(torch, index: int) -> Gpu:  # noqa: ANN001 - the torch module
    name = torch.cuda.get_device_name(index)
    try:
        free, total = torch.cuda.mem_get_info(index)
    except Exception as exc:  # noqa: BLE001 - e.g. a GPU in exclusive-process mode held by another process
        return Gpu(index, name, error=one_line(exc))
    return Gpu(index, name, free_bytes=free, total_bytes=total)


def driver_version() -> str | None:
    """The NVIDIA driver's version: nvidia-smi's answer, else the kernel module's; None without either."""
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                                 text=True, timeout=10)
            if out.returncode == 0 and out.stdout.strip():
                return out.stdout.split()[0]
        except (OSError, subprocess.TimeoutExpired):
            pass
    try:
        return proc_driver_version(Path("/proc/driver/nvidia/version").read_text())
    except OSError:
        return None


def proc_driver_version(text: str) -> str | None:
    """The driver version in ``/proc/driver/nvidia/version``'s text (proprietary or open kernel module)."""
    found = re.search(r"Kernel Module\s+(?:for \S+\s+)?(\d[\w.-]*)", text)
    return found.group(1) if found else None


def import_error(statement: str) -> str | None:
    """None when ``statement`` runs in a fresh interpreter, else the last line of its error."""
    try:
        out = subprocess.run([sys.executable, "-c", statement], capture_output=True, text=True,
                             timeout=IMPORT_TIMEOUT_S, env={**os.environ, "GLOG_minloglevel": "2"})
    except subprocess.TimeoutExpired:
        return f"`{statement}` took over {IMPORT_TIMEOUT_S:g} s"
    return None if out.returncode == 0 else last_error(out.stderr) or f"exit code {out.returncode}"


def last_error(stderr: str) -> str | None:
    """The last ``SomeError: message`` line of a child's stderr (its traceback's last word; glog lines
    around it skipped), else its last line; None when it is empty (pure)."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if re.match(r"^[\w.]+(Error|Exception)\b", line)]
    picked = errors or lines
    return picked[-1] if picked else None


def mooncake_facts(error: str | None) -> Backend:
    dists = installed_mooncake()
    return Backend("mooncake", _with_versions(dists), importable=error is None, import_error=error,
                   gpu_capable=mooncake_gpu_capable(dists))


def nixl_facts(error: str | None, build: str | None) -> Backend:
    wheels = installed_nixl()
    return Backend("nixl", _with_versions(wheels), importable=error is None, import_error=error,
                   gpu_capable=build is not None and nixl_gpu_capable(build, wheels))


def _with_versions(dists: list[str]) -> tuple[str, ...]:
    return tuple(f"{dist} {version(dist) or '?'}" for dist in dists)


def ucx_facts(build: str | None) -> UcxFacts:
    """The transports of the UCX the NIXL wheel that ``nixl`` loads beside torch ``build`` bundles."""
    env = tuple(sorted(f"{name}={value}" for name, value in os.environ.items() if name.startswith("UCX_")))
    modules = [f"nixl_{build}"] if build in ("cu12", "cu13") else ["nixl_cu13", "nixl_cu12"]  # nixl's own order
    for module in modules:
        spec = importlib.util.find_spec(module)
        if spec is None or not spec.submodule_search_locations:
            continue
        libs = Path(next(iter(spec.submodule_search_locations))).parent / f"{module}.libs"
        if not libs.is_dir():
            return UcxFacts(libs.name, unknown_why=f"{libs} is missing (a NIXL wheel without UCX?)", env=env)
        transports, why = ucx_transports(libs)
        return UcxFacts(libs.name, transports, why, env)
    return UcxFacts(unknown_why="no NIXL wheel is installed (UCX comes with it)", env=env)


def rdma_devices() -> tuple[str, ...] | None:
    """The RDMA devices the kernel lists (``mlx5_0``, ...): () when there are none, None when unreadable."""
    try:
        return tuple(sorted(os.listdir(INFINIBAND)))
    except FileNotFoundError:
        return ()
    except OSError:
        return None


def redis_facts(url: str | None, timeout_s: float) -> RedisFacts:
    if url is None:
        return RedisFacts()
    shown = safe_url(url)
    try:
        import redis

        with redis.Redis.from_url(url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s) as client:
            client.ping()
    except Exception as exc:  # noqa: BLE001 - a refused connection, a bad URL, a wrong password alike
        error = one_line(exc)
        password = _password(url)
        return RedisFacts(shown, False, error.replace(password, "***") if password else error)
    return RedisFacts(shown, True)


def _password(url: str) -> str | None:
    """The password in ``url`` (user info or ``?password=``), to keep out of an error message."""
    try:
        parts = urlsplit(url)
        in_query = parse_qs(parts.query).get("password")
        return parts.password or (in_query[0] if in_query else None)
    except ValueError:
        return None
