"""Memory bounded by the work, not by the body: a text body just under the 64 MiB cap (the default
``--max-body-mb``) that cannot fit the context is refused in the first pass, on every role that
takes text and through the router in each mode, with the server's peak RSS growing by less than 4x the body and
no lasting growth.

Before: a 5 MB text made a colocated server work 9.5 s and grow 165x the body in RSS (440 MB kept
after), prefill and decode ~1.6 GB each: the whole text was built by pydantic, rendered and
tokenized before the length check. The peak is measured as the kernel sees it: VmHWM, reset per
process through ``/proc/PID/clear_refs`` (``5``; root, or the processes' owner)."""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import pytest

from process.ports import free_port
from tests.conftest import ServerProcess, launch
from tests.support.devices import DEVICE
from tests.support.redis_fixtures import redis_server  # noqa: F401

pytestmark = pytest.mark.timeout(400)
CAP = 64 << 20  # the default --max-body-mb
BODY_BYTES = CAP - 1024
PEAK_FACTOR = 4  # peak RSS growth below this many times the body
CPU_S = 1.0  # the server's own CPU time for the refusal
LASTING_BYTES = 16 << 20  # RSS after vs before, once the answer is out
SETTLE_S = 10.0  # how long RSS may take to come back (the answer is sent before memory is trimmed)
MIB = 1 << 20


@dataclass(frozen=True)
class Usage:
    rss: int
    hwm: int
    cpu_s: float


def usage(pid: int) -> Usage:
    fields = {}
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            name, _, value = line.partition(":")
            if name in ("VmRSS", "VmHWM"):
                fields[name] = int(value.split()[0]) * 1024
    with open(f"/proc/{pid}/stat") as stat:
        ticks = stat.read().rsplit(")", 1)[1].split()
    return Usage(fields["VmRSS"], fields["VmHWM"], (int(ticks[11]) + int(ticks[12])) / os.sysconf("SC_CLK_TCK"))


def reset_peak(pid: int) -> Usage:
    """VmHWM set back to the current RSS; the usage just after."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as refs:
            refs.write("5")
    except PermissionError:
        pytest.skip("resetting VmHWM (/proc/PID/clear_refs) needs root or the servers' owner")
    return usage(pid)


def text_body(size: int, **extra) -> bytes:
    """A chat body of exactly ``size`` bytes: one user message of plain text."""
    shell = json.dumps({"messages": [{"role": "user", "content": ""}], "max_tokens": 4, **extra}).encode()
    at = shell.index(b'"content": ""') + len(b'"content": "')
    return shell[:at] + b"hello world " * ((size - len(shell)) // 12) + b" " * ((size - len(shell)) % 12) + shell[at:]


def encode_body(size: int) -> bytes:
    shell = b'{"room": 1, "images": [{"data": ""}]}'
    at = shell.index(b'""') + 1
    return shell[:at] + b"A" * (size - len(shell)) + shell[at:]


@pytest.fixture(scope="module")
def servers(tiny_model, redis_server, tmp_path_factory) -> Iterator[dict[str, ServerProcess]]:  # noqa: F811
    model, logs = str(tiny_model("qwen2_vl")), tmp_path_factory.mktemp("memory-logs")
    common = ["--model", model, "--device", DEVICE, "--kv-cache-mib", "16"]
    epd = ["--redis-url", redis_server.url]
    stages = {"colocated": ("colocated", common),
              "prefill": ("prefill", [*common, "--bootstrap-port", str(free_port())]),
              "decode": ("decode", common),
              "encoder": ("encoder", ["--model", model, "--device", DEVICE, "--redis-url", redis_server.url]),
              "epd_prefill": ("prefill", [*common, *epd, "--bootstrap-port", str(free_port())]),
              "epd_decode": ("decode", [*common, *epd])}
    started: dict[str, ServerProcess] = {}
    try:
        with ThreadPoolExecutor(len(stages)) as pool:
            jobs = {name: pool.submit(launch, role, flags, logs / f"{name}.log", 240.0)
                    for name, (role, flags) in stages.items()}
            for name, job in jobs.items():
                started[name] = job.result()
        s = started
        routers = {"router_colocated": ["--colocated", s["colocated"].url],
                   "router_pd": ["--prefill", s["prefill"].url, "--decode", s["decode"].url],
                   "router_epd": ["--encoder", s["encoder"].url, "--prefill", s["epd_prefill"].url,
                                  "--decode", s["epd_decode"].url, "--redis-url", redis_server.url]}
        with ThreadPoolExecutor(len(routers)) as pool:
            jobs = {name: pool.submit(launch, "router", flags, logs / f"{name}.log", 60.0)
                    for name, flags in routers.items()}
            for name, job in jobs.items():
                started[name] = job.result()
        yield started
    finally:
        for server in started.values():
            server.stop()


def refused_within_bounds(servers: dict[str, ServerProcess], to: str, path: str, body: bytes,
                          measured: tuple[str, ...]) -> httpx.Response:
    """Send ``body`` to ``to`` and check each ``measured`` process: its CPU time, its peak RSS growth
    and, within ``SETTLE_S``, no lasting growth. Returns the answer."""
    assert CAP - 4096 < len(body) < CAP
    pids = {name: servers[name].proc.pid for name in measured}
    with httpx.Client(timeout=120) as client:
        before = {name: reset_peak(pid) for name, pid in pids.items()}
        answer = client.post(f"{servers[to].url}{path}", content=body, headers={"content-type": "application/json"})
    after = {name: usage(pid) for name, pid in pids.items()}
    report = {}
    for name, pid in pids.items():
        growth = after[name].hwm - before[name].rss
        report[name] = f"cpu {after[name].cpu_s - before[name].cpu_s:.2f} s, peak +{growth / MIB:.0f} MiB " \
                       f"({growth / len(body):.2f}x)"
        assert after[name].cpu_s - before[name].cpu_s < CPU_S, report
        assert growth < PEAK_FACTOR * len(body), report
        deadline = time.monotonic() + SETTLE_S
        while (lasting := usage(pid).rss - before[name].rss) >= LASTING_BYTES and time.monotonic() < deadline:
            time.sleep(0.2)
        assert lasting < LASTING_BYTES, (name, f"RSS still +{lasting / MIB:.0f} MiB after {SETTLE_S} s")
    print(to, answer.status_code, report)
    return answer


def assert_too_long(answer: httpx.Response) -> None:
    assert answer.status_code == 400, answer.text[:500]
    error = answer.json()["error"]
    assert (error["code"], error["param"], error["type"]) == ("context_length_exceeded", "messages",
                                                              "invalid_request_error"), error
    held = re.match(r"This model's maximum context length is 2048 tokens\. However, your messages hold (\d+) "
                    r"characters of text", error["message"])
    assert held and BODY_BYTES - 200 < int(held[1]) < BODY_BYTES, error  # the text, less the JSON around it


@pytest.mark.parametrize("role", ["colocated", "prefill", "decode"])
def test_a_text_that_cannot_fit_is_refused_within_bounds(servers, role):
    bootstrap = {"bootstrap_host": "127.0.0.1", "bootstrap_port": 1, "bootstrap_room": 1} if role != "colocated" else {}
    answer = refused_within_bounds(servers, role, "/v1/chat/completions", text_body(BODY_BYTES, **bootstrap), (role,))
    assert_too_long(answer)


def test_an_image_over_its_limit_is_refused_within_bounds_by_the_encoder(servers):
    answer = refused_within_bounds(servers, "encoder", "/v1/encode", encode_body(BODY_BYTES), ("encoder",))
    assert answer.status_code == 413, answer.text[:500]
    assert (answer.json()["error"]["code"], answer.json()["error"]["param"]) == ("image_too_large", "images[0]")


@pytest.mark.parametrize("mode, behind", [("router_colocated", ("colocated",)), ("router_pd", ("prefill", "decode")),
                                          ("router_epd", ("epd_prefill", "epd_decode"))])
def test_through_the_router(servers, mode, behind):
    answer = refused_within_bounds(servers, mode, "/v1/chat/completions", text_body(BODY_BYTES), (mode, *behind))
    assert_too_long(answer)


def test_a_text_that_fits_is_still_served(servers):
    """The bound refuses only what cannot fit: a prompt near the context (in tokens) is answered."""
    words = "hello " * 550  # ~1650 tokens of a 2048-token context (3 per word here), far under its character bound
    answer = httpx.post(f"{servers['colocated'].url}/v1/chat/completions", timeout=120,
                        json={"messages": [{"role": "user", "content": words}], "max_tokens": 2})
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["prompt_tokens"] > 1500
