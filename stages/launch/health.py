"""Waiting for a started server to be healthy: ``/health`` answers 200 and, when the starter gave
it an instance id (``process.instance``), its ``/server_info`` shows that id, so a server of
another process answering on the child's port is an error naming the port, never "ready".
Standard library only (urllib): the tests, the benchmarks and ``stage up`` all use it.
"""

from __future__ import annotations

import http.client
import json
import subprocess
import time
import urllib.error
import urllib.request

HEALTH_POLL_S = 0.25
REQUEST_TIMEOUT_S = 2.0


class ForeignServer(RuntimeError):
    """Another process answers on a child's port: its ``/server_info`` shows another instance id (or
    none), or it does not speak HTTP."""


def get(url: str) -> bytes | None:
    """The body of ``url``'s answer when it is a 200, else None (no answer yet, or another status).
    ``ForeignServer`` when what answers does not speak HTTP (e.g. a ZeroMQ socket of another process
    that took the port before the child bound it)."""
    try:
        with urllib.request.urlopen(url, timeout=REQUEST_TIMEOUT_S) as response:
            return response.read() if response.status == 200 else None
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return None
    except http.client.HTTPException as exc:
        raise ForeignServer(f"it answers with something other than HTTP ({type(exc).__name__})") from None


def healthy(url: str, instance_id: str | None = None) -> bool:
    """Whether the server at ``url`` is healthy now: ``/health`` answers 200 and, with ``instance_id``,
    ``/server_info`` answers 200 with that ``instance_id``. ``ForeignServer`` when it shows another."""
    if get(f"{url}/health") is None:
        return False
    if instance_id is None:
        return True
    if (raw := get(f"{url}/server_info")) is None:
        return False
    try:
        info = json.loads(raw)
    except ValueError:
        info = None
    found = info.get("instance_id") if isinstance(info, dict) else None
    if found != instance_id:
        raise ForeignServer(f"its /server_info has instance_id {found!r}, not {instance_id!r}")
    return True


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float, instance_id: str | None = None) -> None:
    """Poll until the server ``proc`` started at ``url`` is ``healthy``. RuntimeError if the process exits
    first, ``ForeignServer`` if another server answers there, TimeoutError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode} before it was healthy")
        if healthy(url, instance_id):
            return
        time.sleep(HEALTH_POLL_S)
    raise TimeoutError(f"{url}/health did not answer 200 within {timeout_s:.0f} s")
