"""The container image (deploy/Containerfile), built as this machine can (deploy/image/build.sh:
mmdebstrap's bookworm base imported by podman under the Containerfile's base name, ``buildah bud
--isolation chroot --format docker``) in a private storage, with a torch wheel in the build context
(pip inside a build cannot see this machine's find-links folder): the CPU one from pip's find-links
folder, or where none is there, the one ``pip download torch==TORCH_VERSION`` fetches from the
configured index (as ``scripts/setup.sh`` installs torch: a CPU index's ``+cpu`` build outranks a plain
one; PyPI has only its CUDA 13 build, which runs on a CPU too and brings its nvidia-* wheels into the
image), kept in the cache dir; the rest from the index. ``podman run`` is refused here (crun and this kernel's hybrid cgroups), so
``buildah from`` + ``buildah run --isolation chroot`` runs it:

- the image's config: the HEALTHCHECK command and timings, the non-root USER, ENTRYPOINT ``stage``;
- inside it, as that user: torch is that wheel's build, and ``stage demo --mode epd``, with no network but
  loopback, makes its model in the user's cache (the image holds none) and answers through encoder,
  prefill, decode and router;
- the image's healthcheck finds a server's port on its command line and reports its 200;
- a build from the work tree itself leaves out what .containerignore names (.git, .venv, caches).

Slow: ~3 min on 2 cores when nothing else runs (the build ~2 min: a fresh machine builds from nothing,
but the base's mmdebstrap tarball is kept for the day in the cache dir). Tools missing fail naming
setup.sh.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import ssl
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from datetime import date
from pathlib import Path

import pytest

from stages.launch.models import cache_dir
from process.ports import free_port
from process.children import start_group, stop_process
from tests.conftest import REPO
from tests.deploy.image_store import ImageStore, missing_tools

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]
CONTAINERFILE = REPO / "deploy" / "Containerfile"
TAG = "localhost/epd-stage:test-cpu"
BUILD_S = 1200.0
DEMO_S = 300.0


def containerfile_arg(name: str) -> str:
    return re.search(rf"^ARG {name}=(.*)$", CONTAINERFILE.read_text(), re.M).group(1)


def pip_config() -> dict[str, str]:
    """``pip config list`` of this machine: key (without its scope) -> value."""
    listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                            check=True, timeout=60).stdout
    return {m.group(1): m.group(2) for m in re.finditer(r"^[^.\n]*\.([\w-]+)='(.*)'$", listed, re.M)}


def torch_wheel() -> Path:
    """torch==TORCH_VERSION+cpu for this Python from pip's find-links folders; where none is there,
    ``pip download --no-deps torch==TORCH_VERSION`` from the configured index (its CPU build where it has
    one), kept in the cache dir (``torch-wheel/``, one file) for the next run. Fails with pip's output."""
    version = containerfile_arg("TORCH_VERSION")
    python = f"cp{sys.version_info.major}{sys.version_info.minor}"
    folders = [Path(f) for f in pip_config().get("find-links", "").split() if Path(f).is_dir()]
    local = [w for folder in folders for w in sorted(folder.glob(f"torch-{version}+cpu-{python}-*.whl"))]
    if local:
        return local[0]
    folder = cache_dir() / "image" / "torch-wheel"
    kept = sorted(folder.glob(f"torch-{version}[-+]*{python}-*.whl"))
    if kept:
        return kept[0]
    partial = folder.with_name(f"torch-wheel.partial.{os.getpid()}")
    done = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                           "-d", str(partial), f"torch=={version}"], capture_output=True, text=True, timeout=BUILD_S)
    wheels = sorted(partial.glob(f"torch-{version}*.whl"))
    if done.returncode != 0 or len(wheels) != 1:
        pytest.fail(f"no torch-{version}+cpu wheel in pip's find-links folders {[str(f) for f in folders]}, and "
                    f"`pip download torch=={version}` from the configured index failed:\n{done.stdout}{done.stderr}")
    folder.parent.mkdir(parents=True, exist_ok=True)
    try:
        partial.rename(folder)  # whole or absent: a parallel run reads no half-written wheel
    except OSError:  # another run kept one first
        shutil.rmtree(partial, ignore_errors=True)
    return sorted(folder.glob(f"torch-{version}*.whl"))[0]


def wheel_torch(wheel: Path) -> tuple[str, str | None]:
    """(``torch.__version__``, ``torch.version.cuda``) as the wheel's ``torch/version.py`` says."""
    with zipfile.ZipFile(wheel) as archive:
        text = archive.read("torch/version.py").decode()
    version = re.search(r"^__version__ = '([^']+)'", text, re.M).group(1)
    cuda = re.search(r"^cuda: Optional\[str\] = (?:'([^']+)'|None)", text, re.M).group(1)
    return version, cuda


def ca_bundle() -> str | None:
    """The CA bundle this machine's pip trusts (pip's ``cert``, else the system's): a proxy that
    intercepts TLS for this machine does so for the build too."""
    cert = pip_config().get("cert") or ssl.get_default_verify_paths().cafile
    return cert if cert and Path(cert).is_file() else None


def base_tarball() -> Path:
    """Where build.sh keeps the base's mmdebstrap tarball between runs on this machine: one per day and
    package list (a tarball made earlier today is what mmdebstrap would make now, give or take a
    same-day update); older ones are removed."""
    packages = re.search(r'pkgs="([^"]*)"', CONTAINERFILE.read_text()).group(1)
    folder = cache_dir() / "image"
    folder.mkdir(parents=True, exist_ok=True)
    name = f"bookworm-minbase-{date.today():%Y%m%d}-{hashlib.sha256(packages.encode()).hexdigest()[:12]}.tar"
    for old in folder.glob("bookworm-minbase-*.tar"):
        if old.name != name:
            old.unlink(missing_ok=True)
    return folder / name


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ImageStore]:
    if missing := missing_tools():
        pytest.fail(f"missing {', '.join(missing)}: run `bash scripts/setup.sh test`")
    image_store = ImageStore(tmp_path_factory.mktemp("image-store"))
    try:
        yield image_store
    finally:
        image_store.close()


@pytest.fixture(scope="module")
def wheel() -> Path:
    return torch_wheel()


@pytest.fixture(scope="module")
def image(store: ImageStore, wheel: Path) -> str:
    """Build the cpu variant (host-memory Mooncake) with torch from ``wheel``: pip in the build takes it
    before the index's (a local ``+cpu`` build outranks the index's 2.13.0; the same file ties with it),
    so the index is PyPI's and the CPU index, which this machine cannot reach, is not asked."""
    command = [str(REPO / "deploy" / "image" / "build.sh"), "--variant", "cpu", "--tag", TAG, "--store",
               str(store.folder), "--runroot", str(store.runroot), "--local-wheel", str(wheel),
               "--torch-index", "https://pypi.org/simple",
               "--base-tar", str(base_tarball())]
    if cert := ca_bundle():
        command += ["--pip-cert", cert]
    log_path = store.folder / "build.log"
    with open(log_path, "wb") as log:
        build = start_group(command, log, os.environ)  # its own group: a build past its time is stopped whole
    try:
        code = build.wait(BUILD_S)
    except subprocess.TimeoutExpired:
        code = None
    finally:
        stop_process(build, group=True)
    output = log_path.read_text(errors="replace")
    if code is None:
        pytest.fail(f"build.sh ran past {BUILD_S} s:\n{output[-8000:]}")
    assert code == 0, f"build.sh exited {code}:\n{output[-8000:]}"
    assert output.rstrip().endswith(f"build.sh: built {TAG}"), output[-3000:]
    return TAG


@pytest.fixture
def container(store: ImageStore, image: str) -> Iterator[str]:
    """A new container of the image for each test (nothing one test writes is seen by another)."""
    name = store.buildah("from", "--pull-never", image).stdout.strip()
    yield name
    store.buildah("rm", name, check=False)


def run_in(store: ImageStore, container: str, script: str, timeout_s: float = 120.0,
           offline: bool = False) -> subprocess.CompletedProcess:
    return store.buildah("run", "--isolation", "chroot", container, "--", "sh", "-c", script,
                         timeout_s=timeout_s, check=False, offline=offline)


def test_image_config_has_healthcheck_user_and_entrypoint(store, image):
    config = json.loads(store.buildah("inspect", "--type", "image", image).stdout)["Docker"]["config"]
    assert config["Healthcheck"] == {"Test": ["CMD", "/opt/epd/bin/python", "/opt/epd/bin/epd-healthcheck"],
                                     "Interval": 30 * 10**9, "Timeout": 5 * 10**9, "StartPeriod": 300 * 10**9,
                                     "Retries": 3}
    assert config["User"] == "epd"
    assert config["Entrypoint"] == ["stage"]
    assert config["Cmd"] == ["serve", "--help"]
    assert "HF_HUB_OFFLINE=1" in config["Env"]


def test_runs_as_non_root_with_the_wheels_torch_and_no_model(store, container, wheel):
    done = run_in(store, container, 'id -un; id -u; python -c "import torch; print(torch.__version__, '
                                    'torch.version.cuda)"; ls "$HOME/.cache/epd-stage" 2>&1; stage serve --help | head -1')
    lines = done.stdout.splitlines()
    assert done.returncode == 0, done.stdout + done.stderr
    version, cuda = wheel_torch(wheel)
    assert version.startswith(containerfile_arg("TORCH_VERSION") + "+"), version
    assert lines[:3] == ["epd", "10001", f"{version} {cuda}"]  # the wheel's build: "2.13.0+cpu None" from find-links
    assert "No such file or directory" in lines[3]  # no model, no cache: the image carries no weights
    assert lines[4].startswith("usage: stage serve [-h]")


def test_demo_epd_answers_inside_the_image(store, container):
    """Offline (loopback alone): the demo generates its model in the container and needs no network."""
    done = run_in(store, container, "stage demo --mode epd --max-tokens 6 --timeout 240", timeout_s=DEMO_S,
                  offline=True)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert "making a random-weight qwen2_vl (tiny) checkpoint in /home/epd/.cache/epd-stage/qwen2_vl-tiny" in lines
    prompt = "prompt: [image: 224x224 PNG, a red disc and a blue square on a gradient] What is in this picture?"
    answer = next(i for i, line in enumerate(lines) if line.startswith("answer (length): "))
    assert lines.index(prompt) < answer
    assert lines[answer + 1] == "finish_reason 'length': the answer was cut at --max-tokens (6 tokens)"
    assert re.match(r"^usage: \d+ prompt \+ 6 completion tokens", lines[answer + 2]), lines[answer + 2]
    assert re.match(r"^room \d+: encoder [\d.]+ ms, prefill [\d.]+ ms", lines[answer + 3]), lines[answer + 3]


def test_healthcheck_finds_the_port_on_the_command_line(store, container):
    """A colocated server on a free port (a tiny model made in the container); the image's healthcheck,
    given the server's pid, reads the port from its command line and reports 200 (exit 0) once the
    model is loaded (a bounded poll: 300 tries, 0.2 s apart)."""
    port = free_port()
    model = "$HOME/.cache/epd-stage/qwen2_vl-tiny"
    script = (f"stage make-model --family qwen2_vl --size tiny --out {model} >/dev/null; "
              f"stage serve colocated --model {model} --port {port} >/dev/null 2>&1 & server=$!; "
              "for i in $(seq 300); do out=$(epd-healthcheck $server); code=$?; [ $code = 0 ] && break; sleep 0.2; "
              'done; kill $server; wait $server; echo "$out"; echo "exit $code"')
    done = run_in(store, container, script, timeout_s=180)
    assert done.stdout.splitlines()[-2:] == [f"epd-healthcheck: healthy: http://127.0.0.1:{port}/health: 200",
                                             "exit 0"], done.stdout + done.stderr


def test_repo_root_as_context_leaves_out_what_containerignore_names(store, image, tmp_path):
    """``buildah bud -f deploy/Containerfile .`` from the work tree: .containerignore keeps the venv,
    git's folder and caches out of the context (a probe build on the same base lists what it got)."""
    left_out = {".git", ".venv", "epd_stage.egg-info"}
    assert all((REPO / name).exists() for name in left_out)  # there to be left out: the check can fail
    probe = tmp_path / "Containerfile"
    probe.write_text(f"FROM {containerfile_arg('BASE_IMAGE')}\nCOPY . /src\n"
                     "RUN echo top: $(ls -A /src); echo pycache: $(find /src -name __pycache__ | wc -l)\n")
    done = store.buildah("bud", "--isolation", "chroot", "--pull=never", "-f", str(probe), "-t", "probe", str(REPO))
    said = dict(line.split(": ", 1) for line in done.stdout.splitlines() if line.startswith(("top: ", "pycache: ")))
    listed = set(said["top"].split())
    assert {"stages", "router", "transfer", "cache", "bench", "pyproject.toml", "README.md", "deploy"} <= listed
    assert not (left_out | {".mypy_cache", ".pytest_cache"}) & listed, listed
    assert said["pycache"] == "0"
