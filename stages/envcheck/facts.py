"""The facts ``stage env`` reports, as plain frozen dataclasses: ``gather.py`` fills them from this machine,
tests fake them, ``verdict.py`` judges them and ``render.py`` prints them. No I/O here.

Conventions: a version is None when the package is absent; an ``error`` is one line (the exception's
``Type: message``), None when the thing worked; every URL is already stripped of its password.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import parse_qsl, urlencode, urlsplit


@dataclass(frozen=True)
class Gpu:
    """One GPU torch sees: ``free_bytes`` / ``total_bytes`` from ``torch.cuda.mem_get_info``
    (None with ``error`` when that call failed, e.g. the GPU is in exclusive use elsewhere)."""

    index: int
    name: str
    free_bytes: int | None = None
    total_bytes: int | None = None
    error: str | None = None


@dataclass(frozen=True)
class TorchFacts:
    """torch and the GPUs it sees. ``version`` None: torch does not import (``error`` says why).
    ``cuda``: ``torch.version.cuda`` (None for a CPU build). ``build``: ``transfer.builds.torch_build``
    of it, None with ``build_error`` for a CUDA version no transfer build exists for.
    ``cuda_reason``: why ``torch.cuda.is_available()`` is False on a CUDA build (torch's warning).
    ``driver``: the NVIDIA driver version (nvidia-smi or /proc/driver/nvidia/version), None if none."""

    version: str | None
    cuda: str | None = None
    build: str | None = None
    build_error: str | None = None
    error: str | None = None
    cuda_reason: str | None = None
    gpus: tuple[Gpu, ...] = ()
    driver: str | None = None


@dataclass(frozen=True)
class Backend:
    """A KV transfer library (``name``: ``"mooncake"`` or ``"nixl"``). ``dists``: the distributions
    installed for it with their versions, e.g. ``("mooncake-transfer-engine-non-cuda 0.3.13.post1",)``
    (for NIXL the ``nixl-cu*`` wheels); empty when none is. ``importable``: the import the backend
    module does succeeded in a child process (``import_error`` otherwise). ``gpu_capable``: the build
    can register GPU memory beside this torch (``transfer.builds``, from metadata)."""

    name: str
    dists: tuple[str, ...] = ()
    importable: bool = False
    import_error: str | None = None
    gpu_capable: bool = False


@dataclass(frozen=True)
class UcxFacts:
    """The UCX that NIXL bundles. ``source``: which wheel's copy was asked (e.g. ``"nixl_cu13.libs"``),
    None when no NIXL wheel is installed. ``transports``: ``"tl/device"`` pairs as ``ucx_info -d`` lists
    them (``"tcp/eth0"``, ``"cuda_copy/cuda"``), None when unknown, ``unknown_why`` saying why.
    ``env``: the ``UCX_*`` variables set here, as ``NAME=value`` (``UCX_TLS``, ``UCX_NET_DEVICES``, ...
    narrow what UCX uses; ``transfer/nixl.py`` sets ``UCX_MODULES=^ib`` for protocol tcp unless set)."""

    source: str | None = None
    transports: tuple[str, ...] | None = None
    unknown_why: str | None = None
    env: tuple[str, ...] = ()


@dataclass(frozen=True)
class RedisFacts:
    """The Redis of ``--redis-url`` / ``EPD_REDIS_URL``: ``url`` None when none was given (then
    ``reachable`` is None too), else the URL without its password and whether it answered PING."""

    url: str | None = None
    reachable: bool | None = None
    error: str | None = None


@dataclass(frozen=True)
class Facts:
    python: str
    platform: str
    torch: TorchFacts
    transformers: str | None  # its version; None: not installed
    backends: tuple[Backend, ...] = ()
    ucx: UcxFacts = field(default_factory=UcxFacts)
    rdma: tuple[str, ...] | None = ()  # /sys/class/infiniband's devices; None: that folder is unreadable
    redis: RedisFacts = field(default_factory=RedisFacts)
    stage: str | None = None  # this project's version (the epd-stage distribution's)

    def backend(self, name: str) -> Backend:
        """The backend called ``name``; an uninstalled one when the facts have none of that name."""
        return next((b for b in self.backends if b.name == name), Backend(name))


def safe_url(url: str) -> str:
    """``url`` with its password (``redis://user:PASS@host``, or ``?password=PASS``) replaced by ``***``."""
    parts = urlsplit(url)
    if parts.password is not None:
        url = url.replace(f":{parts.password}@", ":***@", 1)
    pairs = parse_qsl(parts.query, keep_blank_values=True)
    if any(key == "password" for key, _ in pairs):
        hidden = urlencode([(key, "***" if key == "password" else value) for key, value in pairs], safe="*")
        url = url.replace(f"?{parts.query}", f"?{hidden}", 1)
    return url
