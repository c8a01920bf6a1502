"""Which Mooncake and NIXL builds to install beside a torch, and what to uninstall first: the choice
``scripts/setup.sh`` makes after it has installed torch. ``choose()`` is pure (the installed builds
are its arguments); ``python -m transfer.build_choice --torch VERSION --cuda CUDA`` prints it for
the shell. It runs from the repo root before the project is installed: it imports ``transfer.builds``
alone, which imports only the standard library (``transfer/__init__.py`` imports nothing).

Mooncake: the distribution of ``MOONCAKE_BUILDS`` for torch's build, where the NVIDIA driver is there
(``libcuda.so.1`` loads); beside a CUDA torch on a machine without it (PyPI's torch is a CUDA build, and
it runs on a CPU) the host-memory build, since a CUDA build's ``mooncake.engine`` links ``libcuda.so.1``
and fails to import without it (NIXL's CUDA wheels load without it). All of them install the
``mooncake`` package, and uninstalling one deletes the files another wrote over. So where any other
build is installed, every installed build is uninstalled first, the chosen one too (pip would
otherwise take it as installed with its files gone); where only the chosen one is, nothing is.

NIXL: the ``nixl`` meta package (whose ``__init__`` loads ``nixl_cu12`` or ``nixl_cu13``) requires
both wheels, ~430 MB with their UCX. Installed without dependencies (``pip install --no-deps
nixl==V``) beside the one wheel of torch's CUDA major (``nixl-cuN==V``: the meta package pins its
wheels to its own version), ``import nixl._bindings`` loads that wheel. A CPU torch has no CUDA
major and gets ``CPU_NIXL_WHEEL``: NIXL's loader tries ``nixl_cu13`` first where it finds no CUDA,
it is the smaller wheel (59 MB against 69 MB) and the one beside PyPI's torch (a CUDA 13 build);
either moves host memory (UCX on DRAM). The other ``nixl-cu*`` wheel, where installed, is uninstalled
(it installs a package of its own, so that removes nothing the chosen one needs).
"""

from __future__ import annotations

import argparse
import ctypes
import sys
from dataclasses import dataclass

from transfer.builds import MOONCAKE_BUILDS, NIXL_BUILDS, installed_mooncake, installed_nixl, torch_build

NIXL_VERSION = "1.5.1"  # the meta package and its wheel, one version: transfer/nixl.py's library facts are of it
MOONCAKE_MIN = "0.3.13"
CPU_NIXL_WHEEL = NIXL_BUILDS["cu13"]  # a CPU torch: see the module docstring


@dataclass(frozen=True)
class BuildChoice:
    """The transfer builds for a torch of build ``torch`` (``"cpu"``, ``"cu12"``, ``"cu13"``)."""

    torch: str
    driver: bool  # the NVIDIA driver is there (a CUDA torch alone)
    mooncake: str  # the Mooncake distribution
    nixl_wheel: str  # the nixl-cu* wheel beside the nixl meta package
    uninstall: tuple[str, ...]  # distributions to uninstall before installing, sorted

    @property
    def install(self) -> tuple[str, ...]:
        """Requirements to install with their dependencies (torch, already installed, among them)."""
        return f"{self.mooncake}>={MOONCAKE_MIN}", f"{self.nixl_wheel}=={NIXL_VERSION}"

    @property
    def install_no_deps(self) -> tuple[str, ...]:
        """Requirements to install without dependencies, after ``install``."""
        return (f"nixl=={NIXL_VERSION}",)

    def summary(self, torch_version: str) -> str:
        """One line: ``transfer builds for torch 2.13.0+cpu: mooncake-transfer-engine-non-cuda, nixl + nixl-cu13 ...``."""
        line = f"transfer builds for torch {torch_version}: {self.mooncake}, nixl + {self.nixl_wheel}"
        if self.torch != "cpu" and not self.driver:
            line += " (no NVIDIA driver, libcuda.so.1: Mooncake's host-memory build)"
        elif self.torch == "cpu":
            line += " (CPU torch: host memory only; NIXL's own first choice without CUDA)"
        return line


def choose(cuda_version: str | None, mooncake_installed: list[str], nixl_installed: list[str], *,
           driver: bool) -> BuildChoice:
    """The builds for a torch whose ``torch.version.cuda`` is ``cuda_version`` (None or "" for a CPU
    build), given the Mooncake distributions and nixl-cu* wheels installed now and whether the NVIDIA
    driver is there. ValueError (from ``torch_build``) for a CUDA major that no build is published for."""
    build = torch_build(cuda_version)
    mooncake = MOONCAKE_BUILDS[build if driver else "cpu"]
    nixl_wheel = NIXL_BUILDS.get(build, CPU_NIXL_WHEEL)
    others = [dist for dist in mooncake_installed if dist != mooncake]
    uninstall = set(mooncake_installed) if others else set()
    uninstall |= {wheel for wheel in nixl_installed if wheel != nixl_wheel}
    return BuildChoice(build, driver, mooncake, nixl_wheel, tuple(sorted(uninstall)))


def driver_loads() -> bool:
    """Whether this machine's NVIDIA driver library (``libcuda.so.1``) loads (what a CUDA build of
    Mooncake links)."""
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def render(choice: BuildChoice, torch_version: str) -> str:
    """The lines ``scripts/setup.sh`` reads: ``summary``, ``uninstall``, ``install``, ``install-no-deps``,
    each followed by a space and its value (space-separated; empty where there is nothing)."""
    fields = {"summary": choice.summary(torch_version), "uninstall": " ".join(choice.uninstall),
              "install": " ".join(choice.install), "install-no-deps": " ".join(choice.install_no_deps)}
    return "".join(f"{key} {value}\n" for key, value in fields.items())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m transfer.build_choice",
                                     description="The Mooncake and NIXL builds to install beside a torch.")
    parser.add_argument("--torch", required=True, help="torch.__version__ (for the summary line)")
    parser.add_argument("--cuda", default="", help="torch.version.cuda; empty for a CPU build")
    args = parser.parse_args(argv)
    try:
        choice = choose(args.cuda, installed_mooncake(), installed_nixl(), driver=bool(args.cuda) and driver_loads())
    except ValueError as exc:
        print(f"transfer.build_choice: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(render(choice, args.torch))
    return 0


if __name__ == "__main__":
    sys.exit(main())
