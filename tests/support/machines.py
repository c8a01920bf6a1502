"""Machines for ``stages.launch.placement`` tests: each torch build, the transfer builds beside it."""

from __future__ import annotations

from stages.launch.placement import Machine

NON_CUDA = ("mooncake-transfer-engine-non-cuda",)
BOTH_NIXL = ("nixl-cu12", "nixl-cu13")
CPU = Machine("2.13.0+cpu", "cpu", 0, NON_CUDA, BOTH_NIXL)  # this machine, as setup.sh leaves it


def cuda(build: str, gpus: int, mooncake: tuple[str, ...], nixl: tuple[str, ...] = BOTH_NIXL) -> Machine:
    """A machine with a CUDA torch of ``build`` (``"cu12"``, ``"cu13"``) seeing ``gpus`` GPUs."""
    version = {"cu12": "2.13.0+cu128", "cu13": "2.13.0+cu130"}[build]
    return Machine(version, build, gpus, mooncake, nixl)
