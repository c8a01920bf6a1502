"""The servers the tests fork (tests/support/server_forks.py) are processes of their own, as fresh ones are:
each draws its own start id, answers as the ``stage`` command does, and exits as Popen reports."""

from __future__ import annotations

import os
import signal

import httpx
import pytest

from process.instance import INSTANCE_ENV, instance_id
from tests.support import server_forks
from tests.conftest import launch


def test_a_forked_child_draws_its_own_instance_id(monkeypatch):
    monkeypatch.delenv(INSTANCE_ENV, raising=False)
    mine = instance_id()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report its id and leave without running the parent's cleanup
        os.write(write, instance_id().encode())
        os._exit(0)
    os.close(write)
    child = os.read(read, 64).decode()
    os.close(read)
    assert os.waitpid(pid, 0)[1] == 0
    assert len(child) == 16 and child != mine and instance_id() == mine


@pytest.mark.skipif(server_forks.fresh_interpreters(), reason="servers are fresh interpreters in this run")
def test_two_forked_servers_are_two_processes_with_two_ids(tiny_model, tmp_path):
    flags = ["--model", str(tiny_model("qwen2_vl")), "--kv-cache-mib", "16"]
    servers = [launch("colocated", flags, tmp_path / f"colocated-{i}.log", 120) for i in range(2)]
    try:
        assert all(isinstance(server.proc, server_forks.ForkedProcess) for server in servers)
        infos = [httpx.get(f"{server.url}/server_info", timeout=10).json() for server in servers]
        assert infos[0]["instance_id"] != infos[1]["instance_id"]
        assert len({server.proc.pid for server in servers} | {os.getpid()}) == 3
        servers[0].proc.send_signal(signal.SIGTERM)
        # SIGTERM drains (stages.server: nothing in flight here), then exits 0: a fresh `stage serve` does the same
        assert servers[0].proc.wait(30) == 0
        assert "Finished server process" in servers[0].log()
        assert servers[1].proc.poll() is None
        assert httpx.get(f"{servers[1].url}/health", timeout=10).status_code == 200
    finally:
        for server in servers:
            server.stop()
    assert servers[1].proc.returncode is not None
