"""``EmbeddedRedis``: a real redis-server that starts, answers, and leaves no process behind."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
import redis

from cache.config import MIB
from cache.embedded import EmbeddedRedis

pytestmark = pytest.mark.timeout(30)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a zombie is not alive
        return stat.read().split(")")[-1].split()[0] != "Z"


def wait_dead(pid: int, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.02)
    return False


def test_it_serves_with_the_settings_asked_for_and_stops_cleanly() -> None:
    with EmbeddedRedis(32 * MIB) as server:
        pid, port, directory = server.process.pid, server.port, server._dir
        assert server.url == f"redis://127.0.0.1:{port}/0"
        with redis.Redis.from_url(server.url, socket_timeout=2) as client:
            assert client.ping()
            config = client.config_get("*")
        assert (config["maxmemory"], config["maxmemory-policy"]) == (str(32 * MIB), "volatile-lru")
        assert (config["save"], config["appendonly"], config["bind"]) == ("", "no", "127.0.0.1")
    assert wait_dead(pid)
    assert server.process is None and not directory.exists()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    server.stop()  # twice is fine


def test_it_refuses_a_port_in_use_and_leaves_nothing() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        server = EmbeddedRedis(32 * MIB, port=taken.getsockname()[1], start_timeout_s=5)
        with pytest.raises(RuntimeError, match="redis-server exited with code 1 on port"):
            server.start()
    assert server.process is None and server._dir is None


def test_it_dies_with_a_killed_parent() -> None:
    code = ("import sys; from cache.embedded import EmbeddedRedis; s = EmbeddedRedis(32 << 20).start(); "
            "print(s.process.pid, s._dir, flush=True); sys.stdin.read()")
    with subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) as parent:
        directory = ""
        try:
            pid_text, directory = parent.stdout.readline().decode().split()
            redis_pid = int(pid_text)
            assert alive(redis_pid)
            parent.send_signal(signal.SIGKILL)
            parent.wait(5)
            assert wait_dead(redis_pid), "redis-server outlived its killed parent"
        finally:
            parent.kill()
            shutil.rmtree(directory, ignore_errors=True)  # a killed parent cannot clean up after itself


def test_a_clean_interpreter_exit_stops_it() -> None:
    code = ("from cache.embedded import EmbeddedRedis; s = EmbeddedRedis(32 << 20).start(); "
            "print(s.process.pid, flush=True)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=20, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert wait_dead(int(out.stdout))


@pytest.mark.unit
def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="maxmemory_bytes must be at least 1 MiB, got 1000"):
        EmbeddedRedis(1000)
    with pytest.raises(RuntimeError, match="EmbeddedRedis is not started"):
        EmbeddedRedis(MIB).url
