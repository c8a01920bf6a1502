"""A real Prometheus (Debian's ``prometheus`` package) for the tests: the binaries, and a server on a
free loopback port with its TSDB in a temp dir.

``tool(name) -> str``  the path of ``prometheus`` or ``promtool``; a missing one fails the test
                       naming the command that installs it (never a skip).
``Prometheus(config, workdir)``  ``start()`` writes ``config`` (a dict) to ``workdir/prometheus.yml``
                       and starts the server, ready (``/-/ready`` 200) within ``READY_S`` or
                       AssertionError with its log; ``query``/``series``/``rules`` call the HTTP
                       API (an error answer is an AssertionError naming the query); ``stop()``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from process.ports import free_port
from process.children import start_group, stop_process

READY_S = 60.0
START_ATTEMPTS = 2  # the free port can be taken between probing and binding


def tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed: run `bash scripts/setup.sh test` (Debian's prometheus package)")
    return path


class Prometheus:
    def __init__(self, config: dict[str, Any], workdir: Path) -> None:
        self.config, self.workdir = config, workdir
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def start(self) -> None:
        (self.workdir / "prometheus.yml").write_text(yaml.safe_dump(self.config, sort_keys=False))
        for attempt in range(START_ATTEMPTS):
            port = free_port()
            self.url = f"http://127.0.0.1:{port}"
            with open(self.workdir / "prometheus.log", "wb") as log:
                self.proc = start_group([tool("prometheus"), f"--config.file={self.workdir / 'prometheus.yml'}",
                                         f"--storage.tsdb.path={self.workdir / 'tsdb'}",
                                         f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                                        log, os.environ)
            if self._wait_ready() or attempt == START_ATTEMPTS - 1:
                break
        assert self._ready(), f"prometheus not ready within {READY_S} s:\n{self.log()}"

    def _wait_ready(self) -> bool:
        deadline = time.monotonic() + READY_S
        while time.monotonic() < deadline and self.proc is not None and self.proc.poll() is None:
            if self._ready():
                return True
            time.sleep(0.2)
        return False

    def _ready(self) -> bool:
        try:
            return httpx.get(f"{self.url}/-/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def log(self) -> str:
        return (self.workdir / "prometheus.log").read_text(errors="replace")

    def api(self, path: str, **params: Any) -> Any:
        response = httpx.get(f"{self.url}/api/v1/{path}", params=params, timeout=30)
        body = response.json()
        assert response.status_code == 200 and body["status"] == "success", f"{path} {params}: {body}"
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """The instant vector ``expr`` gives now (a scalar or a string is an error: panels and rules
        are vectors)."""
        data = self.api("query", query=expr)
        assert data["resultType"] == "vector", f"{expr}: {data}"
        return data["result"]

    def series(self, name: str) -> list[dict[str, str]]:
        return self.api("series", **{"match[]": name})

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc, group=True)
