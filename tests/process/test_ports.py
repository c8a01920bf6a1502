"""``free_port`` hands out ports no other process can draw in the moment before a child binds them:
below the kernel's ephemeral range (where every port 0 bind and outgoing connection lands), never one
that is bound, listening or not; and a stack's health check names a port answered by something that
is not HTTP (a ZeroMQ socket of another process, as a CI run once saw) instead of raising
``BadStatusLine``."""

from __future__ import annotations

import socket
import socketserver
import subprocess
import sys
import threading
import time

import pytest

from process import ports
from process.ports import ephemeral_ports, free_port
from stages.launch.stack import Child, ChildSpec, StackError, _wait_healthy

ZMTP_SIGNATURE = b"\xff\x00\x00\x00\x00\x00\x00\x00\x01\x7f"


@pytest.mark.unit
def test_free_ports_lie_below_the_ephemeral_range_and_bind():
    low, high = ephemeral_ports()
    assert 1024 <= low <= high <= 65535
    for _ in range(20):
        port = free_port()
        assert ports._FREE_PORT_LOW <= port < low
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


class _Draws:
    """Stands in for the random generator: ``randrange`` returns ``ports`` in order (pure logic)."""

    def __init__(self, *draws: int) -> None:
        self.draws = list(draws)

    def randrange(self, low: int, high: int) -> int:
        port = self.draws.pop(0)
        assert low <= port < high
        return port


def test_a_bound_port_is_never_handed_out_listening_or_not(monkeypatch):
    with socket.socket() as listening, socket.socket() as bound_only:
        listening.bind(("127.0.0.1", free_port()))
        listening.listen()
        bound_only.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as a stage holds its port while it loads
        bound_only.bind(("127.0.0.1", free_port()))
        spare = free_port()
        taken = [listening.getsockname()[1], bound_only.getsockname()[1]]
        monkeypatch.setattr(ports, "_RANDOM", _Draws(*taken, spare))
        assert free_port() == spare


@pytest.mark.unit
def test_without_room_below_the_ephemeral_range_any_free_port(monkeypatch):
    monkeypatch.setattr(ports, "ephemeral_ports", lambda: (ports._FREE_PORT_LOW + 10, 65535))
    monkeypatch.setattr(ports, "_RANDOM", _Draws())  # drawing at all would fail
    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


class _NotHttp(socketserver.BaseRequestHandler):
    """Answers every connection with a ZeroMQ greeting's first bytes and closes, as the process that
    took a child's port in one CI run did."""

    def handle(self) -> None:
        self.request.sendall(ZMTP_SIGNATURE)


@pytest.mark.timeout(60)
def test_a_childs_port_answered_by_something_not_http_is_named_at_once(tmp_path):
    with socketserver.ThreadingTCPServer(("127.0.0.1", 0), _NotHttp) as other:
        threading.Thread(target=other.serve_forever, daemon=True).start()
        port = other.server_address[1]
        sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        try:
            spec = ChildSpec("prefill", ("stage", "serve", "prefill"), port)
            start = time.monotonic()
            with pytest.raises(StackError) as err:
                _wait_healthy([Child(spec, sleeper, tmp_path / "prefill.log", instance_id="fedcba9876543210")],
                              time.monotonic() + 30)
            assert time.monotonic() - start < 10  # at the first answer, not at the deadline
            assert str(err.value) == (
                f"port {port} is answered by another process, not the prefill this stack started (pid {sleeper.pid}): "
                "it answers with something other than HTTP (BadStatusLine); stop that process or give another port")
        finally:
            sleeper.kill()
            sleeper.wait(10)
            other.shutdown()
