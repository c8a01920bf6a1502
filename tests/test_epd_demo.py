"""``stage demo --mode epd`` as a real process: it starts a private Redis, an encoder, a prefill, a
decode (and the router in front), prints the answer (the same as ``--mode colocated``'s) and the
room's per-stage times, and leaves no process behind."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.generated_models import model_dir

pytestmark = pytest.mark.timeout(240)


def demo(mode: str, workdir: Path) -> str:
    done = subprocess.run([sys.executable, "-m", "stages.cli", "demo", "--mode", mode, "--workdir", str(workdir),
                           "--max-tokens", "6", "--timeout", "180"], cwd=REPO, capture_output=True, text=True,
                          timeout=220)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def processes_mentioning(text: str) -> list[str]:
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in args:
            found.append(f"{cmdline.parent.name}: {args}")
    return found


def listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def test_epd_demo_answers_like_colocated_and_leaves_nothing_running(tmp_path):
    (tmp_path / "qwen2_vl-tiny").symlink_to(model_dir("qwen2_vl"))  # the demo's model, made already
    epd = demo("epd", tmp_path)
    redis_port = int(re.search(r"started redis at redis://127\.0\.0\.1:(\d+)/0", epd).group(1))
    assert re.search(r"^room \d+: encoder [\d.]+ ms", epd, re.M), epd  # the image went through the encoder
    for role in ("encoder", "prefill", "decode"):
        assert re.search(rf"^stopping {role} \(pid \d+\)$", epd, re.M), epd
    answer = re.search(r"^answer \(length\): .*$", epd, re.M).group(0)
    assert processes_mentioning(str(tmp_path)) == []
    assert processes_mentioning(f"--port {redis_port} ") == [] and not listening(redis_port)
    assert re.search(r"^answer \(length\): .*$", demo("colocated", tmp_path), re.M).group(0) == answer
