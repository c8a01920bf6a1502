"""Which builds of the transfer libraries fit which torch, which ones this machine has installed, and
whether each can register GPU memory. No torch, no mooncake or nixl import: distributions are read
from their metadata, so ``scripts/setup.sh``, ``stage env`` and ``stage up``'s checks stay fast.

A torch build is ``"cpu"``, ``"cu12"`` or ``"cu13"`` (``torch.version.cuda``'s major version).

Mooncake publishes one PyPI distribution per build, all installing the ``mooncake`` package (two at
once overwrite each other's files): ``mooncake-transfer-engine-non-cuda`` (host memory only),
``mooncake-transfer-engine`` (CUDA 12) and ``mooncake-transfer-engine-cuda13``. Only a CUDA build
can register GPU memory. NIXL's ``nixl`` package loads ``nixl_cu12`` or ``nixl_cu13``, whichever
matches torch's CUDA major version; both wheels register host and GPU memory.
"""

from __future__ import annotations

import importlib.metadata

TORCH_BUILDS = ("cpu", "cu12", "cu13")
MOONCAKE_BUILDS = {  # torch build -> the Mooncake distribution that fits it
    "cpu": "mooncake-transfer-engine-non-cuda",
    "cu12": "mooncake-transfer-engine",
    "cu13": "mooncake-transfer-engine-cuda13",
}
# Mooncake distributions built with CUDA (the EFA builds too): they can register GPU memory.
MOONCAKE_CUDA_BUILDS = ("mooncake-transfer-engine", "mooncake-transfer-engine-cuda13", "mooncake-transfer-engine-efa",
                        "mooncake-transfer-engine-efa-cuda13")
NIXL_BUILDS = {"cu12": "nixl-cu12", "cu13": "nixl-cu13"}  # the wheel `nixl` loads under torch of that CUDA major


def torch_build(cuda_version: str | None) -> str:
    """``"cpu"`` for a torch without CUDA (``torch.version.cuda`` None), else ``"cu<major>"``.
    ValueError for a CUDA major version no transfer build is published for."""
    if not cuda_version:
        return "cpu"
    build = f"cu{cuda_version.split('.')[0]}"
    if build not in TORCH_BUILDS:
        raise ValueError(f"torch was built for CUDA {cuda_version}; Mooncake and NIXL publish builds for CUDA 12 "
                         "and 13 only: install torch==2.13.0 from a CUDA 12 or 13 index, or the CPU build")
    return build


def installed(package: str) -> list[str]:
    """The distributions that installed the import package ``package`` (``"mooncake"``, ``"nixl_cu13"``),
    sorted; empty when none did."""
    return sorted(set(importlib.metadata.packages_distributions().get(package, [])))


def installed_mooncake() -> list[str]:
    """The Mooncake distributions installed (one, unless two builds collide)."""
    return installed("mooncake")


def mooncake_gpu_capable(builds: list[str]) -> bool:
    """Whether Mooncake installed by ``builds`` (``installed_mooncake()``) can register GPU memory."""
    return bool(builds) and all(build in MOONCAKE_CUDA_BUILDS for build in builds)


def nixl_gpu_capable(torch: str, wheels: list[str]) -> bool:
    """Whether NIXL can register GPU memory beside a torch of build ``torch``: the ``nixl-cu*`` wheel of
    torch's CUDA major version is among ``wheels`` (a CPU torch has no GPU memory to register)."""
    return torch in NIXL_BUILDS and NIXL_BUILDS[torch] in wheels


def installed_nixl() -> list[str]:
    """The ``nixl-cu*`` wheels installed, sorted."""
    return sorted(dist for module in ("nixl_cu12", "nixl_cu13") for dist in installed(module))
