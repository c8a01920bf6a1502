"""Secrets off the command line (``process.secrets``): the Redis URL (its password) and the admin token
come from the flag, a ``-file`` flag or the environment, in that order; both a value and its file is
one line and exit 2, an unreadable or empty file one line naming the flag and the path, never the
content. Real servers: ``stage up --mode epd --redis-url-file`` on a Redis that requires a password
serves an image request (its embedding lands in that Redis), and no process of the stack has the
password on its command line (the children get it as ``EPD_REDIS_URL``); an encoder given only
``--redis-url-file`` (a fresh interpreter, so ``/proc/PID/cmdline`` is its own) encodes into it."""

from __future__ import annotations

import base64
import os
import secrets
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import redis

from cache.embedded import EmbeddedRedis
from process.secrets import REDIS_URL_ENV, TOKEN_ENV, SecretError, read_secret
from cli import build_parser
from cli.serve import server_config
from tests.conftest import REPO
from tests.support.router_helpers import data_url, png
from tests.support.stage_up import Up, cmdlines

pytestmark = pytest.mark.timeout(300)
PASSWORD = secrets.token_hex(16)
TOKEN = "a-token-of-twenty-chars"


# --- pure: precedence and errors -------------------------------------------------------------
@pytest.mark.unit
def test_the_flag_wins_then_the_file_then_the_environment(tmp_path):
    path = tmp_path / "url"
    path.write_text("redis://:from-file@h:1/0\n")
    env = {REDIS_URL_ENV: "redis://:from-env@h:1/0"}
    kw = dict(flag="--redis-url", env=REDIS_URL_ENV)
    assert read_secret("redis://flag", None, environ=env, **kw) == "redis://flag"
    assert read_secret(None, str(path), environ=env, **kw) == "redis://:from-file@h:1/0"
    assert read_secret(None, None, environ=env, **kw) == "redis://:from-env@h:1/0"
    assert read_secret(None, None, environ={REDIS_URL_ENV: ""}, **kw) is None
    assert read_secret(None, None, environ={}, **kw) is None
    assert read_secret("", None, environ=env, **kw) == "redis://:from-env@h:1/0"  # an empty flag is none
    path.write_text("two-newlines\n\n")  # one trailing newline is dropped, not more
    assert read_secret(None, str(path), environ={}, **kw) == "two-newlines\n"
    path.write_text("no-newline")
    assert read_secret(None, str(path), environ={}, **kw) == "no-newline"


@pytest.mark.unit
def test_errors_name_the_flag_and_the_path_never_the_content(tmp_path):
    kw = dict(flag="--admin-token", env=TOKEN_ENV, environ={})
    cases = [(("t" * 20, str(tmp_path)), "give --admin-token or --admin-token-file, not both"),
             ((None, str(tmp_path / "missing")),
              f"--admin-token-file {tmp_path / 'missing'}: cannot read it (No such file or directory)"),
             ((None, str(tmp_path)), f"--admin-token-file {tmp_path}: cannot read it (Is a directory)")]
    empty = tmp_path / "empty"
    empty.write_text(" \n")
    cases.append(((None, str(empty)), f"--admin-token-file {empty}: the file is empty"))
    binary = tmp_path / "binary"
    binary.write_bytes(b"\xff\xfe" + PASSWORD.encode())
    cases.append(((None, str(binary)), f"--admin-token-file {binary}: cannot read it (UnicodeDecodeError)"))
    for (value, path), message in cases:
        with pytest.raises(SecretError) as err:
            read_secret(value, path, **kw)
        assert str(err.value) == message
        assert PASSWORD not in str(err.value)


@pytest.mark.unit
def test_stage_servers_read_the_url_and_token_with_that_precedence(tmp_path, monkeypatch):
    parser = build_parser()
    url_file, token_file = tmp_path / "url", tmp_path / "token"
    url_file.write_text(f"redis://:{PASSWORD}@127.0.0.1:1/0\n")
    token_file.write_text("t" * 16 + "-from-file\n")
    monkeypatch.setenv(REDIS_URL_ENV, "redis://:env@127.0.0.1:2/0")
    monkeypatch.setenv(TOKEN_ENV, "t" * 16 + "-from-env")

    def config(role: str, *flags: str):
        return server_config(parser.parse_args(["serve", role, "--model", "/m", *flags]), role)

    decode = config("decode", "--redis-url-file", str(url_file), "--admin-token-file", str(token_file))
    assert decode.disagg.cache.url == f"redis://:{PASSWORD}@127.0.0.1:1/0"
    assert decode.disagg.admin_token == "t" * 16 + "-from-file"
    decode = config("decode")  # the environment alone: EPD mode, and the token
    assert (decode.disagg.cache.url, decode.disagg.admin_token) == ("redis://:env@127.0.0.1:2/0", "t" * 16 + "-from-env")
    assert config("encoder", "--redis-url", "redis://flag:3/0").encoder.cache.url == "redis://flag:3/0"
    monkeypatch.delenv(REDIS_URL_ENV)
    assert config("prefill").disagg.cache is None  # no URL anywhere: PD mode
    with pytest.raises(ValueError) as err:
        config("encoder")
    assert str(err.value) == "the encoder needs its cache's Redis: give --redis-url, --redis-url-file or EPD_REDIS_URL"


def stage(*argv: str, env: dict | None = None) -> tuple[int, str]:
    done = subprocess.run([sys.executable, "-m", "cli", *argv], cwd=REPO, capture_output=True, text=True,
                          timeout=60, env={**os.environ, **(env or {})})
    return done.returncode, done.stderr.strip()


def test_every_role_answers_a_bad_secret_in_one_line_and_exit_2(tmp_path):
    empty = tmp_path / "empty"
    empty.write_text("\n")
    url = "redis://127.0.0.1:1/0"
    cases = [
        (("serve", "encoder", "--model", "/m", "--redis-url", url, "--redis-url-file", str(empty)),
         "stage serve encoder: error: give --redis-url or --redis-url-file, not both"),
        (("serve", "prefill", "--model", "/m", "--redis-url-file", str(empty)),
         f"stage serve prefill: error: --redis-url-file {empty}: the file is empty"),
        (("serve", "pd", "--model", "/m", "--admin-token-file", str(tmp_path / "none")),
         f"stage serve pd: error: --admin-token-file {tmp_path / 'none'}: cannot read it (No such file or directory)"),
        (("serve", "router", "--colocated", "http://127.0.0.1:1", "--admin-token", TOKEN, "--admin-token-file",
          str(empty)), "stage serve router: error: give --admin-token or --admin-token-file, not both"),
        (("serve", "router", "--colocated", "http://127.0.0.1:1", "--redis-url-file", str(empty)),
         f"stage serve router: error: --redis-url-file {empty}: the file is empty"),
        (("up", "--port", "0", "--redis-url-file", str(tmp_path)),
         f"stage up: error: --redis-url-file {tmp_path}: cannot read it (Is a directory)"),
        (("up", "--port", "0", "--admin-token-file", str(empty)),
         f"stage up: error: --admin-token-file {empty}: the file is empty"),
    ]
    for argv, line in cases:
        assert stage(*argv) == (2, line), argv


@pytest.mark.unit
def test_stage_up_reads_the_environment_only_in_epd_mode(monkeypatch):
    from stages.launch.up import stack_config
    from tests.support.machines import CPU

    parser = build_parser()
    monkeypatch.setenv(REDIS_URL_ENV, "redis://:pw@127.0.0.1:9/0")
    assert stack_config(parser.parse_args(["up", "--port", "0"]), CPU).redis_url == "redis://:pw@127.0.0.1:9/0"
    assert stack_config(parser.parse_args(["up", "--port", "0", "--mode", "pd"]), CPU).redis_url is None


# --- real servers on a Redis with a password -------------------------------------------------
@pytest.fixture(scope="module")
def locked_redis() -> Iterator[str]:
    """A real Redis that requires ``PASSWORD`` (set at runtime: not on its own command line either)."""
    with EmbeddedRedis(64 << 20) as server:
        with redis.Redis(port=server.port, socket_timeout=5) as client:
            client.config_set("requirepass", PASSWORD)
        yield f"redis://:{PASSWORD}@127.0.0.1:{server.port}/0"


def embedding_keys(url: str) -> list[bytes]:
    with redis.Redis.from_url(url, socket_timeout=5) as client:
        return [key for key in client.scan_iter(count=1000)]


def test_stage_up_epd_with_the_password_in_a_file_only(locked_redis, tiny_model, tmp_path):
    with redis.Redis.from_url(locked_redis, socket_timeout=5) as client:
        client.flushall()
    url_file = tmp_path / "redis-url"
    url_file.write_text(locked_redis + "\n")
    up = Up("--model", str(tiny_model("qwen2_vl")), "--port", "0", "--kv-cache-mib", "16", "--redis-url-file",
            str(url_file), log_dir=tmp_path / "logs")
    try:
        ready = up.wait_line("stage up: ready: ", 240)
        children = up.children()
        assert list(children) == ["encoder", "prefill", "decode", "router"]
        client = openai.OpenAI(base_url=ready.split()[3], api_key="x", max_retries=0, timeout=60)
        image = {"type": "image_url", "image_url": {"url": data_url(png(48, 32, 7))}}
        reply = client.chat.completions.create(
            model=client.models.list().data[0].id, max_tokens=4, temperature=0, extra_body={"ignore_eos": True},
            messages=[{"role": "user", "content": [image, {"type": "text", "text": "What is it?"}]}])
        client.close()
        assert (reply.choices[0].finish_reason, reply.usage.completion_tokens) == ("length", 4)
        assert embedding_keys(locked_redis) != []  # the encoder wrote the embedding into the locked Redis
        for role in ("encoder", "prefill", "decode"):
            info = httpx.get(f"http://127.0.0.1:{children[role][0]}/server_info", timeout=10).json()
            assert PASSWORD not in str(info)
        mine = {up.proc.pid, *(pid for _, pid in children.values())}
        leaks = [(pid, argv) for pid, argv in cmdlines().items() if any(PASSWORD in a for a in argv)]
        assert leaks == [] and all(pid in cmdlines() for pid in mine)
        up.proc.send_signal(signal.SIGTERM)
        assert up.finish(60)[0] == 0
    finally:
        up.kill()


def test_an_encoder_with_only_a_url_file_encodes_into_the_locked_redis(locked_redis, tiny_model, start_server,
                                                                       tmp_path, monkeypatch):
    monkeypatch.setenv("EPD_TEST_FRESH_SERVERS", "1")  # its own interpreter: /proc/PID/cmdline is its argv
    with redis.Redis.from_url(locked_redis, socket_timeout=5) as client:
        client.flushall()
    url_file = tmp_path / "redis-url"
    url_file.write_text(locked_redis)
    encoder = start_server("encoder", "--model", str(tiny_model("qwen2_vl")), "--redis-url-file", str(url_file))
    argv = (Path(f"/proc/{encoder.proc.pid}") / "cmdline").read_bytes().decode().split("\0")
    assert "--redis-url-file" in argv and not any(PASSWORD in a for a in argv)
    info = httpx.get(f"{encoder.url}/server_info", timeout=10).json()
    assert info["redis_url"] == locked_redis.replace(PASSWORD, "***")
    data = base64.b64encode(png(40, 24, 3)).decode()
    response = httpx.post(f"{encoder.url}/v1/encode", json={"room": 1, "images": [{"data": data}]}, timeout=60)
    assert response.status_code == 200, response.text
    assert [image["status"] for image in response.json()["images"]] == ["encoded"]
    assert embedding_keys(locked_redis) != []
