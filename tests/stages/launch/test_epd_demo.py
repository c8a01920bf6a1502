"""``stage demo --mode epd`` as a real process: it starts a private Redis, an encoder, a prefill, a
decode (and the router in front), prints the prompt, then the answer (the same as ``--mode
colocated``'s), what its finish_reason means and the room's per-stage times, all before the stop
lines, and leaves no process behind; its log directory is a new run under WORKDIR/logs, of which the
last 10 are kept."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.support.generated_models import model_dir

pytestmark = pytest.mark.timeout(240)


def demo(mode: str, workdir: Path) -> str:
    done = subprocess.run([sys.executable, "-m", "cli", "demo", "--mode", mode, "--workdir", str(workdir),
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
    earlier = [tmp_path / "logs" / f"demo-epd-20260101-0000{i:02d}-{100 + i}" for i in range(11)]
    for path in earlier:
        path.mkdir(parents=True)
    epd = demo("epd", tmp_path)
    redis_port = int(re.search(r"started redis at redis://127\.0\.0\.1:(\d+)/0", epd).group(1))
    lines = epd.splitlines()
    assert f"epd mode, model {tmp_path / 'qwen2_vl-tiny'}: encoder cpu, prefill cpu, decode cpu; KV over mooncake" \
        in lines  # this machine's torch sees no GPU (stages.launch.placement)
    answer = next(line for line in lines if line.startswith("answer (length): "))
    said = [lines.index(line) for line in (
        "prompt: [image: 224x224 PNG, a red disc and a blue square on a gradient] What is in this picture?", answer,
        "finish_reason 'length': the answer was cut at --max-tokens (6 tokens)")]
    room = next(i for i, line in enumerate(lines) if re.match(r"^room \d+: encoder [\d.]+ ms", line))  # encoded
    stops = [i for i, line in enumerate(lines) if re.match(r"^stopping (encoder|prefill|decode) \(pid \d+\)$", line)]
    assert said == sorted(said) and len(stops) == 3 and said[-1] < room < min(stops), epd
    logs = sorted((tmp_path / "logs").iterdir())
    assert logs[:-1] == earlier[2:] and logs[-1].name.startswith("demo-epd-2")  # the last 10 runs, this one too
    assert sorted(p.name for p in logs[-1].iterdir()) == ["decode.log", "encoder.log", "prefill.log", "router.log"]
    assert processes_mentioning(str(tmp_path)) == []
    assert processes_mentioning(f"--port {redis_port} ") == [] and not listening(redis_port)
    assert re.search(r"^answer \(length\): .*$", demo("colocated", tmp_path), re.M).group(0) == answer
