"""``stage up`` as a real process: it starts a mode's stack on the tiny model, serves a chat request
through the printed URL (official client), and on SIGTERM leaves no process and no listening port
behind; a SIGKILLed ``stage up`` takes its children with it; a child that cannot start stops
everything with a message naming it. The admin API: ``--admin-token`` reaches the router and the
stages and the ready line prints the admin URL; without it ``stage admin`` is told which flag or
variable turns it on, and with a wrong token which flag or variable gives it. Plus the pure parts:
each mode's command lines and the config's refusals."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from cli import build_parser
from stages.config import TOKEN_ENV
from stages.launch.stack import StackConfig, router_spec, stage_specs
from stages.launch.up import stack_config
from tests.support.machines import CPU
from tests.conftest import REPO
from tests.support.router_helpers import data_url, png
from tests.support.stage_up import Up, cmdlines

pytestmark = pytest.mark.timeout(300)
STARTUP_S = 240.0
STOP_S = 60.0
REDIS = re.compile(r"^stage up: started redis at redis://127\.0\.0\.1:(\d+)")
TOKEN = "a-token-of-twenty-chars"


# --- pure: command lines and config ----------------------------------------------------------
def config(mode: str, **kw) -> StackConfig:
    return StackConfig(model=Path("/m"), log_dir=Path("/logs"), mode=mode, **kw)


@pytest.mark.unit
def test_pd_command_lines():
    cfg = config("pd", stage_args=("--kv-cache-mib=16",))
    stages = stage_specs(cfg, iter([5001, 5002, 5003]))
    assert [(s.role, s.port, s.other_ports) for s in stages] == [("prefill", 5001, (5002,)), ("decode", 5003, ())]
    assert stages[0].argv[0] == sys.executable
    assert list(stages[0].argv[1:]) == ["-m", "cli", "serve", "prefill", "--model", "/m", "--host", "127.0.0.1",
                                        "--threads", "1", "--port", "5001", "--transfer", "mooncake",
                                        "--bootstrap-port", "5002", "--kv-cache-mib=16"]  # stage_args last: they win
    assert list(stages[1].argv[4:]) == ["decode", "--model", "/m", "--host", "127.0.0.1", "--threads", "1",
                                        "--port", "5003", "--transfer", "mooncake", "--kv-cache-mib=16"]
    router = router_spec(cfg, stages, 8080)
    assert (router.role, router.url) == ("router", "http://127.0.0.1:8080")
    assert list(router.argv[4:]) == ["router", "--host", "127.0.0.1", "--port", "8080",
                                     "--prefill", "http://127.0.0.1:5001", "--decode", "http://127.0.0.1:5003",
                                     "--startup-timeout-s", "300.0"]


@pytest.mark.unit
def test_epd_and_colocated_command_lines():
    cfg = config("epd", transfer="nixl", threads=2)
    encoder, prefill, decode = stage_specs(cfg, iter(range(6001, 6010)))  # the Redis URL goes in their environment
    assert list(encoder.argv[4:]) == ["encoder", "--model", "/m", "--host", "127.0.0.1", "--threads", "2",
                                      "--port", "6001"]
    assert list(prefill.argv[-6:]) == ["--port", "6002", "--transfer", "nixl", "--bootstrap-port", "6003"]
    assert list(decode.argv[-2:]) == ["--transfer", "nixl"]
    router = router_spec(cfg, [encoder, prefill, decode], 9000)
    assert list(router.argv[9:]) == ["--encoder", "http://127.0.0.1:6001", "--prefill", "http://127.0.0.1:6002",
                                     "--decode", "http://127.0.0.1:6004", "--startup-timeout-s", "300.0"]
    sized = stage_specs(config("epd", kv_cache_mib=16), iter(range(6001, 6010)))
    assert ["--kv-cache-mib" in s.argv for s in sized] == [False, True, True]  # the encoder has no KV pool
    shared = stage_specs(config("epd", devices=("cuda:0",), memory_shares=(None, 0.4, 0.4)), iter(range(6001, 6010)))
    assert [s.argv[s.argv.index("--device") + 1] for s in shared] == ["cuda:0"] * 3
    assert ["--gpu-memory-utilization" in s.argv for s in shared] == [False, True, True]
    assert shared[1].argv[shared[1].argv.index("--gpu-memory-utilization") + 1] == "0.4"
    (colocated,) = stage_specs(config("colocated"), iter([7001]))
    assert list(colocated.argv[4:]) == ["colocated", "--model", "/m", "--host", "127.0.0.1", "--threads", "1",
                                        "--port", "7001"]


@pytest.mark.unit
@pytest.mark.parametrize("kw, message", [
    (dict(mode="disagg"), "--mode must be one of ('epd', 'pd', 'colocated'), got 'disagg'"),
    (dict(mode="pd", transfer="tcp"), "--transfer must be one of ('mooncake', 'nixl'), got 'tcp'"),
    (dict(mode="pd", redis_url="redis://127.0.0.1:1/0"),
     "--redis-url is for --mode epd (the embedding cache); --mode pd has no cache"),
    (dict(mode="pd", port=70000), "--port must be in [0, 65535], got 70000"),
    (dict(mode="pd", threads=0), "--threads must be >= 1, got 0"),
    (dict(mode="pd", startup_timeout_s=0), "--startup-timeout-s must be > 0, got 0"),
    (dict(mode="pd", admin_token="short"), "--admin-token (or EPD_ADMIN_TOKEN) must be at least 16 characters"),
])
def test_config_refusals_name_the_flag(kw, message):
    with pytest.raises(ValueError) as err:
        config(**kw)
    assert str(err.value) == message


@pytest.mark.unit
def test_the_admin_token_comes_from_the_flag_or_the_environment(monkeypatch):
    parser = build_parser()
    monkeypatch.setenv(TOKEN_ENV, "from-the-environment-x")
    assert stack_config(parser.parse_args(["up", "--port", "0"]), CPU).admin_token == "from-the-environment-x"
    assert stack_config(parser.parse_args(["up", "--port", "0", "--admin-token", TOKEN]), CPU).admin_token == TOKEN
    monkeypatch.delenv(TOKEN_ENV)
    assert stack_config(parser.parse_args(["up", "--port", "0"]), CPU).admin_token is None


# --- the real command ------------------------------------------------------------------------
def leftovers(log_dir: Path, ports: list[int]) -> list[tuple[int, list[str]]]:
    """Processes whose command line names the log dir, or one of the ports as a flag value or in a URL."""
    marks = {f":{p}" for p in ports}
    found = []
    for pid, argv in cmdlines().items():
        if pid == os.getpid():
            continue
        named = any(str(log_dir) in a for a in argv)
        named |= any(a.startswith("--") and a.endswith("port") and v in {str(p) for p in ports}
                     for a, v in zip(argv, argv[1:]))
        named |= any(a.startswith("http://127.0.0.1") and any(a.endswith(m) for m in marks) for a in argv)
        if named:
            found.append((pid, argv))
    return found


def refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    except ConnectionRefusedError:
        return True
    return False


def assert_all_gone(up: Up, pids: list[int], ports: list[int], within_s: float) -> None:
    deadline = time.monotonic() + within_s
    while alive := [pid for pid in pids if Path(f"/proc/{pid}").exists()]:
        assert time.monotonic() < deadline, f"children still alive: {alive}"
        time.sleep(0.1)
    assert leftovers(up.log_dir, ports) == []
    assert [p for p in ports if not refused(p)] == []


def admin(router: str, *flags: str) -> tuple[int, str, str]:
    """``stage admin workers --router ROUTER FLAGS`` (no token in its environment): code, stdout, stderr."""
    env = {key: value for key, value in os.environ.items() if key != TOKEN_ENV}
    done = subprocess.run([sys.executable, "-m", "cli", "admin", "workers", "--router", router, *flags],
                          cwd=REPO, capture_output=True, text=True, timeout=60, env=env)
    return done.returncode, done.stdout, done.stderr


def check_admin_api(router: str, children: dict[str, tuple[int, int]], token: str | None) -> None:
    """With ``token`` (stage up --admin-token): the router's admin API takes it and nothing else, and a
    decode has it too (a wrong token is 401 there, not 403 "disabled"). Without: 403 naming the flag
    and the variable."""
    if token is None:
        assert admin(router) == (1, "", "stage admin: HTTP 403: admin API disabled: start the router with "
                                        "--admin-token or the EPD_ADMIN_TOKEN environment variable (stage up takes "
                                        "the same flag and variable)\n")
        return
    code, table, _ = admin(router, "--token", token)
    assert code == 0 and [line.split()[1] for line in table.splitlines()[1:]] == [
        role for role in children if role != "router"]
    assert admin(router, "--token", token + "x") == (1, "", "stage admin: HTTP 401: wrong admin token (give the "
                                                            "router's admin token with --token or the EPD_ADMIN_TOKEN "
                                                            "environment variable)\n")
    if "decode" in children:
        response = httpx.post(f"http://127.0.0.1:{children['decode'][0]}/admin/allowed_bootstrap", timeout=10,
                              json={"host": "127.0.0.1", "port": 1}, headers={"Authorization": "Bearer wrong"})
        assert (response.status_code, response.json()["error"]["code"]) == (401, "unauthorized")


@pytest.fixture
def model(tiny_model) -> str:
    return str(tiny_model("qwen2_vl"))


@pytest.mark.parametrize("mode, roles, token", [("epd", ["encoder", "prefill", "decode", "router"], None),
                                                ("pd", ["prefill", "decode", "router"], TOKEN),
                                                ("colocated", ["colocated", "router"], None)])
def test_up_serves_through_the_router_and_sigterm_leaves_nothing(model, tmp_path, mode, roles, token):
    flags = () if mode == "epd" else ("--mode", mode)  # epd is the default
    flags += ("--admin-token", token) if token else ()
    up = Up(*flags, "--model", model, "--port", "0", "--kv-cache-mib", "16", log_dir=tmp_path / "logs")
    try:
        ready = up.wait_line("stage up: ready: ", STARTUP_S)
        children = up.children()
        assert list(children) == roles
        router = f"http://127.0.0.1:{children['router'][0]}"
        admin_api = (f"admin API {router}/admin (stage admin --router {router}, with the --admin-token token)" if token
                     else "admin API off (give stage up --admin-token or EPD_ADMIN_TOKEN)")
        assert ready == f"stage up: ready: {router}/v1 (OpenAI base URL); {admin_api}; Ctrl-C stops everything"
        check_admin_api(router, children, token)
        assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == sorted(f"{r}.log" for r in roles)
        client = openai.OpenAI(base_url=ready.split()[3], api_key="x", max_retries=0, timeout=60)
        image = {"type": "image_url", "image_url": {"url": data_url(png(48, 32, 1))}}
        kwargs = dict(model=client.models.list().data[0].id, max_tokens=6, temperature=0,
                      messages=[{"role": "user", "content": [image, {"type": "text", "text": "Say something."}]}],
                      extra_body={"ignore_eos": True})
        reply = client.chat.completions.create(**kwargs)
        assert (reply.choices[0].finish_reason, reply.usage.completion_tokens) == ("length", 6)
        streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**kwargs, stream=True)
                           if c.choices)
        assert streamed == reply.choices[0].message.content != ""
        client.close()

        bootstrap = [int(m) for m in re.findall(r"--bootstrap-port (\d+)", " ".join(
            cmdlines()[children["prefill"][1]]))] if "prefill" in children else []
        assert len(bootstrap) == (mode in ("pd", "epd"))
        pids = [pid for _, pid in children.values()]
        redis = [int(m[1]) for m in map(REDIS.match, up.lines) if m]
        assert len(redis) == (mode == "epd")
        ports = [port for port, _ in children.values()] + bootstrap + redis
        up.proc.send_signal(signal.SIGTERM)
        code, stderr = up.finish(STOP_S)
        assert code == 0, stderr
        assert up.lines[-1] == "stage up: stopped"
        assert [line for line in up.lines if line.startswith("stage up: stopping ")] == [
            f"stage up: stopping {role} (pid {children[role][1]})" for role in reversed(roles)]
        assert_all_gone(up, pids, ports, within_s=5)
    finally:
        up.kill()


def test_killed_up_takes_its_children_with_it(model, tmp_path):
    up = Up("--mode", "colocated", "--model", model, "--port", "0", "--kv-cache-mib", "16",
            log_dir=tmp_path / "logs")
    try:
        up.wait_line("stage up: ready: ", STARTUP_S)
        children = up.children()
        up.proc.kill()  # no handler runs: only PR_SET_PDEATHSIG can end the children
        up.proc.wait(10)
        assert_all_gone(up, [pid for _, pid in children.values()], [port for port, _ in children.values()],
                        within_s=30)
    finally:
        up.kill()


def test_a_child_that_cannot_start_stops_everything_and_names_itself(model, tmp_path):
    """Every stage gets a flag only a prefill takes: the decode exits at startup, and the prefill, already
    started, is stopped; the error names the decode, its log and the log's end. (A GPU the machine lacks
    no longer reaches a child: stage up refuses it before anything starts, tests/cli/test_mistakes.py.)"""
    up = Up("--mode", "pd", "--model", model, "--port", "0", "--kv-cache-mib", "16",
            "--stage-arg=--peer-heartbeat-s=1", log_dir=tmp_path / "logs")
    try:
        code, stderr = up.finish(STARTUP_S)
        children = up.children()
        assert code == 1
        assert list(children) == ["prefill", "decode"]
        decode_log = tmp_path / "logs" / "decode.log"
        assert stderr.startswith(f"stage up: error: decode at http://127.0.0.1:{children['decode'][0]} "
                                 f"(pid {children['decode'][1]}, log {decode_log}) exited with code 2 before "
                                 "it was healthy; the end of its log:\n"), stderr
        assert stderr.endswith("stage: error: unrecognized arguments: --peer-heartbeat-s=1\n\n"), stderr
        assert up.lines[-2:] == [f"stage up: stopping prefill (pid {children['prefill'][1]})", "stage up: stopped"]
        assert_all_gone(up, [pid for _, pid in children.values()], [children["prefill"][0]], within_s=5)
    finally:
        up.kill()
