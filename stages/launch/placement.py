"""Where ``stage up`` and ``stage demo`` put each stage of a mode, over which KV transfer, and with what
share of a shared GPU: decided before anything starts, from what this machine has (``Machine``), so a
combination that cannot work is one line naming the fix (``ValueError``), never a child's traceback.

    machine = Machine.here()                                   # imports torch (device count)
    placement = place("epd", requested=(), transfer=None, machine=machine)
    placement.devices   # ("cuda:0", "cuda:0", "cuda:0") on a one-GPU machine; ("cpu",) * 3 without a GPU
    placement.transfer  # "mooncake" when its build can register GPU memory, else "nixl"
    placement.memory_shares  # (None, 0.4, 0.4): --gpu-memory-utilization of each stage sharing a GPU

Devices: ``requested`` is ``stage up --device``: () or ``("auto",)`` puts every stage on a GPU when torch
sees one, else on the CPU; one value applies to every stage; one per stage (start order) is taken as
given, ``auto`` entries resolved. Automatic GPUs: with as many GPUs as stages, one each in start order;
with fewer, the prefill and the decode spread over the first two, the encoder beside the prefill (an
image is encoded just before its prompt is prefilled, so the two rarely peak together) and a colocated
server on ``cuda:0``.

Memory: a GPU holding one stage leaves ``--gpu-memory-utilization`` at the server's default (vLLM's
0.9). Where several share one GPU, each KV stage (prefill, decode) on it gets an equal part of
``SHARED_BUDGET``, less ``ENCODER_RESERVE`` for an encoder beside them (its vision tower and
activations; it has no KV pool): one GPU running E, P and D gives the prefill and the decode 0.4 each.

Transfer (pd and epd only): ``None`` picks Mooncake where it can move the stages' memory (any build for
host memory; a CUDA build for GPU memory), else NIXL; an explicit choice that cannot is refused,
naming the installed build and the fix (``transfer.builds``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from stages.engine.config import check_device
from transfer.builds import (MOONCAKE_BUILDS, installed_mooncake, installed_nixl, mooncake_gpu_capable,
                             nixl_gpu_capable, torch_build)

KV_ROLES = ("prefill", "decode", "colocated")  # the stages with a KV pool sized by --gpu-memory-utilization
SHARED_BUDGET = 0.9  # of a GPU's memory, for all the stages sharing it (vLLM's default for one)
ENCODER_RESERVE = 0.1  # of a shared GPU's memory, left to an encoder beside the KV stages
SETUP_FIX = "rerun scripts/setup.sh (it installs the builds that match torch)"


@dataclass(frozen=True)
class Machine:
    """What placement reads off this machine: torch's version and build (``transfer.builds.torch_build``),
    the GPUs torch sees, and the transfer libraries installed (distribution names)."""

    torch_version: str
    torch_build: str
    gpus: int
    mooncake: tuple[str, ...]
    nixl: tuple[str, ...]

    @classmethod
    def here(cls) -> Machine:
        """This machine. Imports torch (seconds); counts no GPU when torch has no CUDA or no driver."""
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return cls(torch.__version__, torch_build(torch.version.cuda), gpus, tuple(installed_mooncake()),
                   tuple(installed_nixl()))

    def can_move(self, transfer: str, gpu: bool) -> str | None:
        """Why ``transfer`` cannot move this machine's KV (``gpu``: the KV lives in GPU memory), or None."""
        if transfer == "mooncake":
            if not self.mooncake:
                return f"Mooncake is not installed; {SETUP_FIX}"
            if gpu and not mooncake_gpu_capable(list(self.mooncake)):
                return (f"the installed {', '.join(self.mooncake)} cannot register GPU memory; rerun scripts/setup.sh "
                        f"(it installs {MOONCAKE_BUILDS[self.torch_build]}, the build for torch {self.torch_version}), "
                        "or --transfer nixl, or --device cpu")
            return None
        if not self.nixl:
            return f"NIXL is not installed; {SETUP_FIX}"
        if gpu and not nixl_gpu_capable(self.torch_build, list(self.nixl)):
            return (f"the installed {', '.join(self.nixl)} does not match torch {self.torch_version}; {SETUP_FIX}, "
                    "or --transfer mooncake, or --device cpu")
        return None


@dataclass(frozen=True)
class Placement:
    """Each stage's ``--device`` and ``--gpu-memory-utilization`` (None: the server's default) in start
    order, and the KV transfer (None in colocated mode, which moves no KV)."""

    roles: tuple[str, ...]
    devices: tuple[str, ...]
    memory_shares: tuple[float | None, ...]
    transfer: str | None

    def describe(self) -> str:
        """One line: ``encoder cuda:0, prefill cuda:0 (0.4 of it), decode cuda:0 (0.4 of it); KV over mooncake``."""
        stages = ", ".join(f"{role} {device}" + (f" ({share} of it)" if share is not None else "")
                           for role, device, share in zip(self.roles, self.devices, self.memory_shares))
        return stages + (f"; KV over {self.transfer}" if self.transfer else "")


def place(roles: tuple[str, ...], requested: tuple[str, ...], transfer: str | None, machine: Machine) -> Placement:
    """The placement of ``roles`` (a mode's stages in start order, ``stages.launch.stack.STAGE_ROLES``).
    ValueError, one line naming the flag and the fix, for a GPU torch does not see or a transfer that
    cannot move the KV where it lives."""
    devices = _devices(roles, requested, machine)
    shares = _memory_shares(roles, devices)
    if len(roles) == 1:  # colocated: no KV moves
        return Placement(roles, devices, shares, None)
    gpu = any(device != "cpu" for role, device in zip(roles, devices) if role != "encoder")
    if transfer is None:
        transfer = "mooncake" if machine.can_move("mooncake", gpu) is None else "nixl"
        if (why := machine.can_move(transfer, gpu)) is not None:
            raise ValueError(f"no KV transfer can move {'GPU' if gpu else 'host'} memory here: {why}")
    elif (why := machine.can_move(transfer, gpu)) is not None:
        raise ValueError(f"--transfer {transfer}: {why}")
    return Placement(roles, devices, shares, transfer)


def _devices(roles: tuple[str, ...], requested: tuple[str, ...], machine: Machine) -> tuple[str, ...]:
    if len(requested) not in (0, 1, len(roles)):
        raise ValueError(f"--device takes one device for every stage or one per stage ({','.join(roles)}), "
                         f"got {','.join(requested)}")
    wanted = requested * len(roles) if len(requested) == 1 else requested or ("auto",) * len(roles)
    auto = _auto_devices(roles, machine.gpus)
    return tuple(auto[i] if spec == "auto" else _explicit(spec, machine) for i, spec in enumerate(wanted))


def _explicit(spec: str, machine: Machine) -> str:
    check_device(spec)
    if spec == "cpu":
        return spec
    index = int(spec.partition(":")[2] or 0)
    if not machine.gpus:
        raise ValueError(f"--device {spec}: torch {machine.torch_version} sees no GPU (a CPU build of torch, or no "
                         "driver: stage env says which); use --device cpu, or rerun scripts/setup.sh with a CUDA torch")
    if index >= machine.gpus:
        raise ValueError(f"--device {spec}: torch sees {machine.gpus} GPU(s); use cuda:N with N < {machine.gpus}")
    return f"cuda:{index}"


def _auto_devices(roles: tuple[str, ...], gpus: int) -> tuple[str, ...]:
    """Where ``auto`` puts each role (see the module docstring)."""
    if not gpus:
        return ("cpu",) * len(roles)
    if gpus >= len(roles):
        return tuple(f"cuda:{i}" for i in range(len(roles)))
    kv = {"prefill": 0, "decode": 1 % gpus, "colocated": 0, "encoder": 0}
    return tuple(f"cuda:{kv[role]}" for role in roles)


def _memory_shares(roles: tuple[str, ...], devices: tuple[str, ...]) -> tuple[float | None, ...]:
    """``--gpu-memory-utilization`` of each stage: None where a stage has its GPU (or the CPU) to itself or
    has no KV pool; an equal part of the shared budget for each KV stage sharing a GPU."""
    shares: list[float | None] = []
    for role, device in zip(roles, devices):
        sharing = [r for r, d in zip(roles, devices) if d == device]
        if device == "cpu" or role not in KV_ROLES or len(sharing) == 1:
            shares.append(None)
            continue
        kv = sum(r in KV_ROLES for r in sharing)
        budget = SHARED_BUDGET - ENCODER_RESERVE * (len(sharing) - kv)
        shares.append(math.floor(budget / kv * 100) / 100)
    return tuple(shares)
