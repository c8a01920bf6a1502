"""The image's healthcheck (deploy/image/healthcheck.py) on this machine: the URL it reads from a
``stage`` command line (ports and hosts as ``stage``'s parser gives them), and real answers: a router
started as ``python -m cli serve router`` found by its pid (200, exit 0), ``EPD_HEALTH_URL``
on a colocated server (200) and on a closed port (refused, exit 1). Not slow: no image is built."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from process.ports import free_port
from tests.conftest import REPO

SCRIPT = REPO / "deploy" / "image" / "healthcheck.py"
pytestmark = pytest.mark.timeout(300)


def load_healthcheck():
    spec = importlib.util.spec_from_file_location("epd_healthcheck", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


healthcheck = load_healthcheck()


def run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60,
                          cwd=REPO, env=env)


@pytest.mark.unit
@pytest.mark.parametrize(("argv", "url"), [
    ("serve prefill --model m", "http://127.0.0.1:8100/health"),
    ("serve decode --model m --transfer nixl", "http://127.0.0.1:8200/health"),
    ("serve pd --model m", "http://127.0.0.1:8150/health"),
    ("serve encoder --model m --redis-url redis://r:6379/0", "http://127.0.0.1:8300/health"),
    ("serve colocated --model m", "http://127.0.0.1:8000/health"),
    ("serve router --colocated http://c:8000", "http://127.0.0.1:8080/health"),
    ("serve prefill --model m --host 0.0.0.0 --port 9100", "http://127.0.0.1:9100/health"),
    ("serve decode --model m --host :: --port 9200", "http://[::1]:9200/health"),
    ("serve decode --model m --host 127.0.0.5", "http://127.0.0.5:8200/health"),
    ("up --mode pd --port 9080", "http://127.0.0.1:9080/health"),
    ("serve prefill --model m --port 0", None),
    ("demo --mode epd", None),
    ("serve --help", None),
    ("make-model --family qwen2_vl --out m", None),
])
def test_url_from_the_command_line(argv, url):
    assert healthcheck.health_url(argv.split()) == url


@pytest.mark.unit
def test_command_line_that_does_not_parse_is_an_error():
    with pytest.raises(ValueError, match=r"^the command line does not parse \(exit 2\): stage serve prefill$"):
        healthcheck.health_url(["serve", "prefill"])  # --model is required


@pytest.mark.unit
@pytest.mark.parametrize(("cmdline", "argv"), [
    (["/opt/epd/bin/python3", "/opt/epd/bin/stage", "serve", "router"], ["serve", "router"]),
    (["python", "-m", "cli", "demo"], ["demo"]),
    (["/sbin/docker-init", "--", "stage", "serve", "prefill"], ["serve", "prefill"]),  # docker run --init
    (["sh", "-c", "sleep 1"], None),
    (["sh", "-c", "stage serve prefill --model m"], None),  # a shell's one argument: EPD_HEALTH_URL (README)
])
def test_stage_arguments_in_a_process_command_line(cmdline, argv):
    assert healthcheck.stage_argv(cmdline) == argv


@pytest.fixture(scope="module")
def colocated(start_server, tiny_model):
    return start_server("colocated", "--model", str(tiny_model("qwen2_vl")))


def test_router_found_by_its_pid_is_healthy(start_server, colocated):
    router = start_server("router", "--colocated", colocated.url)  # a fresh `python -m cli serve router`
    done = run(str(router.proc.pid))
    assert (done.returncode, done.stdout) == (0, f"epd-healthcheck: healthy: {router.url}/health: 200\n"), done.stderr


def test_health_url_from_the_environment(colocated):
    done = run(env={"EPD_HEALTH_URL": f"{colocated.url}/health", "PATH": "/usr/bin:/bin"})
    assert (done.returncode, done.stdout) == (0, f"epd-healthcheck: healthy: {colocated.url}/health: 200\n")


def test_closed_port_is_unhealthy():
    url = f"http://127.0.0.1:{free_port()}/health"
    done = run(env={"EPD_HEALTH_URL": url, "PATH": "/usr/bin:/bin"})
    assert done.returncode == 1
    refused = "URLError: <urlopen error [Errno 111] Connection refused>"
    assert done.stdout == f"epd-healthcheck: unhealthy: {url}: {refused}\n"


def test_a_process_that_serves_nothing_is_healthy():
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        done = run(str(sleeper.pid))
    finally:
        sleeper.kill()
        sleeper.wait()
    assert (done.returncode, done.stdout) == (0, f"epd-healthcheck: process {sleeper.pid} serves nothing (sleep 30): "
                                                 "healthy\n")
