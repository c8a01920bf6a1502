"""A newcomer's mistakes on the command line, each answered by the real CLI (run as a subprocess) with
one line on stderr naming what to change and exit code 2, before torch or transformers is imported:
a ``--model`` directory that is missing or lacks what the role loads, a port in use (``--port``, a
fixed ``--bootstrap-port``, the router's and ``stage up``'s ``--port``), for every role that takes
them. "At once" is checked twice: no torch/transformers import (``-X importtime``; the slow part a
wrong answer used to wait for) and a wall time far below a model load's, with a margin that holds
on one loaded core. Also: ``stage serve --help`` has a line per role; a server of another process
on a ``stage up`` child's port is refused by its instance id; ``stage up`` and ``stage demo`` default
to the same model; run log directories are pruned to the last 10."""

from __future__ import annotations

import errno
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from cli import build_parser
from stages.launch.health import wait_healthy
from process.ports import free_port
from process.children import stop_process
from stages.launch.run_logs import KEEP_RUNS, new_run_dir
from stages.launch.stack import Child, ChildSpec, StackError, _wait_healthy
from tests.conftest import REPO, launch

pytestmark = pytest.mark.timeout(120)
AT_ONCE_S = 3.0  # python + argparse take ~0.5 s; importing torch and loading the tiny model, 4-5 s
HEAVY = ("torch", "transformers")
ROLE_FLAGS = {"colocated": (), "prefill": ("--bootstrap-port", "0"), "decode": (),
              "encoder": ("--redis-url", "redis://127.0.0.1:1/0"), "pd": ("--bootstrap-port", "0")}
IN_USE = "{flag} {port}: 127.0.0.1:{port} is already in use by another process; stop it or give another {flag} " \
         "(0: any free port)"


def cli(*argv: str) -> tuple[int, str, str, float]:
    """``python -X importtime -m cli ARGV``: exit code, stdout, stderr without the import-time
    lines, and the wall time. Fails if torch or transformers was imported."""
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "cli", *argv], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    seconds = time.monotonic() - start
    imports = [line.rsplit("|", 1)[1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")]
    assert [m for m in imports if m.split(".")[0] in HEAVY] == []
    stderr = "".join(line + "\n" for line in done.stderr.splitlines() if not line.startswith("import time:"))
    return done.returncode, done.stdout, stderr, seconds


def assert_one_line(argv: tuple[str, ...], line: str) -> None:
    code, stdout, stderr, seconds = cli(*argv)
    assert (code, stdout, stderr) == (2, "", line + "\n")
    assert seconds < AT_ONCE_S


def model_copy(source: Path, into: Path, *, without: tuple[str, ...]) -> Path:
    """A copy of the checkpoint ``source`` lacking the files named in ``without``."""
    into.mkdir()
    for entry in source.iterdir():
        if entry.name not in without:
            shutil.copy(entry, into / entry.name)
    return into


@pytest.fixture
def model(tiny_model) -> Path:
    return tiny_model("qwen2_vl")


@pytest.fixture
def taken() -> Iterator[int]:
    """A port another process holds (listening) while the test runs."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


# --- --model ---------------------------------------------------------------------------------
@pytest.mark.parametrize("role", list(ROLE_FLAGS))
def test_a_missing_or_empty_model_directory_is_one_line_for_every_role(role, tmp_path):
    for path, why in [(tmp_path / "nonexistent", "no such directory"),
                      (tmp_path, "no config.json in it (not a Hugging Face checkpoint directory)")]:
        assert_one_line(("serve", role, "--model", str(path), "--port", "0", *ROLE_FLAGS[role]),
                        f"stage serve {role}: error: --model {path}: {why}")


@pytest.mark.parametrize("role, without, why", [
    ("decode", ("tokenizer.json",), "no tokenizer in it (tokenizer.json, tokenizer.model, vocab.json)"),
    ("colocated", ("preprocessor_config.json",), "no preprocessor_config.json in it (the image processor's config)"),
    ("encoder", ("preprocessor_config.json",), "no preprocessor_config.json in it (the image processor's config)"),
    ("prefill", ("model.safetensors",), "no weights in it (*.safetensors, pytorch_model*.bin)"),
    ("encoder", ("model.safetensors",), "no weights in it (*.safetensors, pytorch_model*.bin)"),
])
def test_a_model_directory_without_what_the_role_loads_names_it(role, without, why, model, tmp_path):
    path = model_copy(model, tmp_path / "partial", without=without)
    assert_one_line(("serve", role, "--model", str(path), "--port", "0", *ROLE_FLAGS[role]),
                    f"stage serve {role}: error: --model {path}: {why}")


def test_a_file_is_not_a_model_directory_and_stage_up_checks_too(model, tmp_path):
    config = model / "config.json"
    assert_one_line(("serve", "colocated", "--model", str(config)),
                    f"stage serve colocated: error: --model {config}: not a directory")
    assert_one_line(("up", "--model", str(tmp_path / "nonexistent"), "--port", "0", "--log-dir", str(tmp_path / "logs")),
                    f"stage up: error: --model {tmp_path / 'nonexistent'}: no such directory")
    assert not (tmp_path / "logs").exists()  # nothing was started


# --- ports in use ----------------------------------------------------------------------------
@pytest.mark.parametrize("role, flags, flag", [
    ("colocated", ("--port", "{port}"), "--port"),
    ("decode", ("--port", "{port}"), "--port"),
    ("encoder", ("--port", "{port}", "--redis-url", "redis://127.0.0.1:1/0"), "--port"),
    ("prefill", ("--port", "0", "--bootstrap-port", "{port}"), "--bootstrap-port"),
    ("pd", ("--port", "0", "--bootstrap-port", "{port}"), "--bootstrap-port"),
    ("prefill", ("--port", "{port}", "--bootstrap-port", "0"), "--port"),
])
def test_a_port_in_use_is_one_line_before_the_model_loads(role, flags, flag, model, taken):
    assert_one_line(("serve", role, "--model", str(model), *(f.format(port=taken) for f in flags)),
                    f"stage serve {role}: error: " + IN_USE.format(flag=flag, port=taken))


def test_a_starting_server_holds_its_port_while_the_model_loads(model, tmp_path):
    """The HTTP socket is bound before the model loads (the "loading" line comes after it), so no other
    process can take the port in between; the server then serves on it."""
    port = free_port()
    log = tmp_path / "colocated.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "cli", "serve", "colocated", "--model", str(model),
                                 "--port", str(port), "--kv-cache-mib", "16", "--device", "cpu"], cwd=REPO,
                                stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 60
        while "INFO stages.server: loading " not in log.read_text(errors="replace"):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text(errors="replace")
            time.sleep(0.05)
        with socket.socket() as intruder, pytest.raises(OSError) as refused:
            intruder.bind(("127.0.0.1", port))
        assert refused.value.errno == errno.EADDRINUSE
        wait_healthy(f"http://127.0.0.1:{port}", proc, 180)
    finally:
        stop_process(proc)


def test_the_routers_port_in_use_is_one_line(taken):
    assert_one_line(("serve", "router", "--port", str(taken), "--colocated", "http://127.0.0.1:9"),
                    "stage serve router: error: " + IN_USE.format(flag="--port", port=taken))


def test_stage_up_with_its_port_in_use_starts_nothing(model, taken, tmp_path):
    assert_one_line(("up", "--model", str(model), "--port", str(taken), "--log-dir", str(tmp_path / "logs")),
                    "stage up: error: " + IN_USE.format(flag="--port", port=taken))
    assert not (tmp_path / "logs").exists()


@pytest.mark.parametrize("command", ["up", "demo"])
def test_a_gpu_torch_does_not_see_is_one_line_before_anything_starts(command, model, tmp_path):
    """This machine's torch sees no GPU: ``--device cuda`` is refused naming the fix (after torch is
    imported to count GPUs, so no import-time check), nothing started, no log directory made."""
    where = ("--log-dir", str(tmp_path / "logs"), "--port", "0") if command == "up" else ("--workdir", str(tmp_path))
    done = subprocess.run([sys.executable, "-m", "cli", command, "--model", str(model), "--device", "cuda", *where],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    torch_version = subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__)"],
                                   capture_output=True, text=True, timeout=60).stdout.strip()
    assert (done.returncode, done.stdout, done.stderr) == (
        2, "", f"stage {command}: error: --device cuda: torch {torch_version} sees no GPU (a CPU build of torch, "
               "or no driver: stage env says which); use --device cpu, or rerun scripts/setup.sh with a CUDA torch\n")
    assert not (tmp_path / "logs").exists()


def test_stage_up_refuses_a_server_of_another_process_on_a_childs_port(model, tmp_path):
    """The server on the port is a real colocated server with its own instance id: a child expecting
    another id is refused at once with the port named; expecting the server's own id, it is healthy."""
    other = launch("colocated", ["--model", str(model), "--kv-cache-mib", "16"], tmp_path / "other.log", 180.0,
                   env={"EPD_INSTANCE_ID": "0123456789abcdef"})
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert httpx.get(f"{other.url}/server_info", timeout=10).json()["instance_id"] == "0123456789abcdef"
        spec = ChildSpec("router", ("stage", "serve", "router"), other.port)
        mine = Child(spec, sleeper, tmp_path / "router.log", instance_id="fedcba9876543210")
        start = time.monotonic()
        with pytest.raises(StackError) as err:
            _wait_healthy([mine], time.monotonic() + 30)
        assert time.monotonic() - start < 10  # at the first answer, not at the deadline
        assert str(err.value) == (
            f"port {other.port} is answered by another process, not the router this stack started (pid {sleeper.pid}): "
            "its /server_info has instance_id '0123456789abcdef', not 'fedcba9876543210'; stop that process or give "
            "another port")
        _wait_healthy([Child(spec, sleeper, tmp_path / "router.log", instance_id="0123456789abcdef")],
                      time.monotonic() + 30)
    finally:
        sleeper.kill()
        sleeper.wait(10)
        other.stop()


# --- addresses on no interface of this machine ------------------------------------------------------
ELSEWHERE = "198.51.100.7"  # TEST-NET-2: on no interface of any test machine
NOT_HERE = "{flag} '{host}' is on no network interface of this machine; give one of its addresses ({why})"


@pytest.mark.parametrize("role, flags, flag, why", [
    ("colocated", ("--host", ELSEWHERE), "--host", "the HTTP server listens on it"),
    ("encoder", ("--host", ELSEWHERE, "--redis-url", "redis://127.0.0.1:1/0"), "--host",
     "the HTTP server listens on it"),
    ("decode", ("--transfer-host", ELSEWHERE), "--transfer-host", "peers dial it for the KV"),
    ("prefill", ("--transfer-host", ELSEWHERE, "--bootstrap-port", "0"), "--transfer-host",
     "peers dial it for the KV"),
    ("prefill", ("--bootstrap-host", ELSEWHERE, "--bootstrap-port", "0"), "--bootstrap-host",
     "decodes dial it for the KV handshake"),
    ("pd", ("--bootstrap-host", ELSEWHERE, "--bootstrap-port", "0"), "--bootstrap-host",
     "decodes dial it for the KV handshake"),
])
def test_an_address_on_no_interface_is_one_line_naming_its_flag(role, flags, flag, why, model):
    assert_one_line(("serve", role, "--model", str(model), "--port", "0", *flags),
                    f"stage serve {role}: error: " + NOT_HERE.format(flag=flag, host=ELSEWHERE, why=why))


def test_mooncake_refuses_an_ipv6_only_transfer_host_naming_the_flag_that_set_it(model):
    """Mooncake's handshake dials IPv4 only; the transfer host defaults to --host, so the line names
    --host when --transfer-host was not given."""
    why = ("has no IPv4 address, and Mooncake's handshake dials IPv4 only; give an IPv4 --transfer-host (HTTP "
           "and the bootstrap may stay on IPv6) or use --transfer nixl")
    assert_one_line(("serve", "decode", "--model", str(model), "--port", "0", "--host", "::1"),
                    f"stage serve decode: error: --host '::1' {why}")
    assert_one_line(("serve", "prefill", "--model", str(model), "--port", "0", "--bootstrap-port", "0",
                     "--transfer-host", "::1"), f"stage serve prefill: error: --transfer-host '::1' {why}")


# --- help, defaults, logs --------------------------------------------------------------------
def test_stage_serve_help_has_a_line_for_every_role():
    done = subprocess.run([sys.executable, "-m", "cli", "serve", "--help"], cwd=REPO, capture_output=True,
                          text=True, timeout=60, env={**os.environ, "COLUMNS": "100"})
    assert done.returncode == 0, done.stderr
    lines = {line.split(None, 1)[0]: line.split(None, 1)[1] for line in done.stdout.splitlines()
             if line.startswith("    ") and len(line.split(None, 1)) == 2}
    assert sorted(lines) == sorted(["colocated", "prefill", "decode", "encoder", "pd", "router"])
    assert all(len(text) > 20 for text in lines.values()), lines


@pytest.mark.unit
def test_stage_up_and_stage_demo_default_to_the_same_model():
    parser = build_parser()
    up, demo = parser.parse_args(["up"]), parser.parse_args(["demo"])
    assert (up.family, up.size) == (demo.family, demo.size) == ("qwen2_vl", "tiny")


@pytest.mark.unit
def test_run_log_directories_are_pruned_to_the_last_ten(tmp_path):
    older = [tmp_path / f"up-20260101-0000{i:02d}-{100 + i}" for i in range(12)]
    for path in older:
        path.mkdir()
    keep = [tmp_path / "mine", tmp_path / "up-notes.txt"]  # not run directories: never touched
    keep[0].mkdir()
    keep[1].write_text("x")
    fresh = new_run_dir(tmp_path, "demo-epd")
    assert fresh.is_dir() and fresh.name.startswith("demo-epd-")
    assert sorted(p for p in tmp_path.iterdir() if p not in keep) == sorted([*older[-(KEEP_RUNS - 1):], fresh])
    assert all(p.exists() for p in keep)
