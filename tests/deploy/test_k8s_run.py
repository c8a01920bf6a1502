"""The cpu-demo overlay's own commands, run as processes on this machine as the pods would run them:
each pod gets its own loopback address as ``POD_IP`` (127.0.0.11-13, the router 127.0.0.10; all of
127/8 is this machine's), listens on the port its manifest says, and reads its secrets from the
environment its manifest builds (the demo Secret's values; Redis is a real one requiring that
password, at the address the test gives it). A real DNS server (dnsmasq) answers the headless
Services' names with those addresses, and the router is pointed at it (``--discover-nameserver``:
in a pod, the cluster's DNS is the system's). dnsmasq holds them under ``.test`` (it answers only
there, AAAA included), which stands in for the pod's DNS search domain (``epd.svc.cluster.local``):
``--discover encoder=dns://epd-encoder:8300`` is run as ``dns://epd-encoder.test:8300``. Then every
probe path and the scrape path answer 200 on the port the manifest names, a chat request with an
image goes through the router's DNS-found encoder, prefill and decode, and no process's command line
holds the Redis password.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import redis

from cache.embedded import EmbeddedRedis
from stages.launch.health import get, wait_healthy
from process.instance import INSTANCE_ENV, new_instance_id
from process.children import start_group, stop_process
from tests.deploy.k8s_manifests import container_env, expand, ours, render, secret_values, workloads
from tests.support.dnsmasq import Dnsmasq
from tests.support.router_helpers import ask, data_url, messages, png

REPO = Path(__file__).resolve().parents[2]
POD_IPS = {"router": "127.0.0.10", "encoder": "127.0.0.11", "prefill": "127.0.0.12", "decode": "127.0.0.13",
           "pd": "127.0.0.14"}
START_S = 180.0  # a stage loads its model before it listens
PROBES = ("startupProbe", "readinessProbe", "livenessProbe")
SEARCH = "test"  # the domain dnsmasq answers for, standing in for the pod's search domain


class Pods:
    """The processes started for the pods, stopped (SIGTERM, then SIGKILL) at the end."""

    def __init__(self, logs: Path) -> None:
        self.logs, self.procs = logs, []

    def run(self, role: str, argv: list[str], env: dict[str, str]) -> tuple[str, subprocess.Popen]:
        instance = new_instance_id()
        with open(self.logs / f"{role}.log", "wb") as log:
            proc = start_group([sys.executable, "-m", "cli", *argv], log,
                               {**os.environ, **env, INSTANCE_ENV: instance, "PYTHONUNBUFFERED": "1"})
        self.procs.append(proc)
        return instance, proc

    def log(self, role: str) -> str:
        return (self.logs / f"{role}.log").read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        for proc in reversed(self.procs):
            stop_process(proc, group=True)


@pytest.fixture
def pods(tmp_path: Path) -> Iterator[Pods]:
    started = Pods(tmp_path)
    yield started
    started.stop()


def pod_command(container: dict[str, Any], role: str, secrets: dict, model: Path, redis_url: str,
                ) -> tuple[list[str], dict[str, str]]:
    """The container's argv and env as Kubernetes would build them in a pod at ``POD_IPS[role]``, with
    the model where this machine has it and the in-cluster Redis's address swapped for the test's."""
    env = container_env(container, secrets, {"status.podIP": POD_IPS[role], "metadata.namespace": "epd"})
    if "EPD_REDIS_URL" in env:
        env["EPD_REDIS_URL"] = env["EPD_REDIS_URL"].replace("epd-redis:6379", urlsplit(redis_url).netloc)
    argv = [expand(arg, env) for arg in container["args"]]
    if "--model" in argv:
        argv[argv.index("--model") + 1] = str(model)
    return argv, env


def searched(discover: str) -> str:
    """``ROLE=dns://NAME:PORT`` with NAME completed by the search domain, as the pod's resolver would."""
    name, port = discover.rsplit(":", 1)
    return f"{name}.{SEARCH}:{port}"


def value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_the_cpu_demo_pods_commands_serve_through_the_dns_discovering_router(pods, tiny_model, tmp_path):
    objects = render("cpu-demo")
    secrets = secret_values(objects)
    password = secrets[("epd-secrets", "redis-password")]
    containers = {labels["app.kubernetes.io/component"]: ours(spec)[-1]
                  for _, spec, labels in workloads(objects) if ours(spec)}
    (decode,) = [spec for _, spec, labels in workloads(objects) if labels["app.kubernetes.io/component"] == "decode"]
    assert ours(decode)[0]["args"] == ["make-model", "--family", "qwen2_vl", "--size", "tiny", "--out", "/models/model"]
    model = tiny_model("qwen2_vl")  # the same generator, options and seed as the init container's: the same files

    with EmbeddedRedis(256 << 20) as server:
        with redis.Redis.from_url(server.url, socket_timeout=2) as client:
            client.config_set("requirepass", password)
        names = {f"epd-{role}.{SEARCH}": [POD_IPS[role]] for role in ("encoder", "prefill", "decode")}
        dns = Dnsmasq.start(tmp_path / "dns", names)
        try:
            stage_urls = {}
            for role in ("encoder", "prefill", "decode"):
                argv, env = pod_command(containers[role], role, secrets, model, server.url)
                instance, proc = pods.run(role, argv, env)
                stage_urls[role] = url = f"http://{POD_IPS[role]}:{value(argv, '--port')}"
                try:
                    wait_healthy(url, proc, START_S, instance)
                except (RuntimeError, TimeoutError) as exc:
                    pytest.fail(f"{role}: {exc}\n{pods.log(role)}")
                check_probes(containers[role], url, objects)

            argv, env = pod_command(containers["router"], "router", secrets, model, server.url)
            argv = [searched(arg) if "=dns://" in arg else arg for arg in argv]
            instance, proc = pods.run("router", [*argv, "--discover-nameserver", dns.address], env)
            router = f"http://{POD_IPS['router']}:{value(argv, '--port')}"
            try:
                wait_healthy(router, proc, 60.0, instance)
            except (RuntimeError, TimeoutError) as exc:
                pytest.fail(f"router: {exc}\n{pods.log('router')}")
            check_probes(containers["router"], router, objects)

            workers = admin_workers(router, env["EPD_ADMIN_TOKEN"])
            assert sorted((w["role"], w["url"], w["source"]) for w in workers) == sorted(
                (role, stage_urls[role], f"dns://epd-{role}.{SEARCH}:{stage_urls[role].rsplit(':', 1)[1]}")
                for role in ("encoder", "prefill", "decode"))
            text, usage = ask(f"{router}/v1", messages("What is in the image?", [data_url(png(64, 48, 1))]),
                              stream=False, max_tokens=8)
            assert usage["completion_tokens"] == 8 and text, (text, pods.log("router"))
            for proc in pods.procs:  # the password reached every process by env only
                assert password not in Path(f"/proc/{proc.pid}/cmdline").read_text(errors="replace")
        finally:
            dns.stop()


def test_the_pd_pools_command_answers_its_probes(pods, tiny_model):
    """The pd overlay's switchable worker (its GPU flag aside: this runs on CPU) before any role."""
    objects = render("pd")
    (spec,) = [spec for _, spec, labels in workloads(objects) if labels["app.kubernetes.io/component"] == "pd"]
    container = ours(spec)[-1]
    argv, env = pod_command(container, "pd", secret_values(objects), tiny_model("qwen2_vl"), "redis://unused:1/0")
    at = argv.index("--device")
    assert argv[at:at + 2] == ["--device", "cuda"]
    del argv[at:at + 2]
    instance, proc = pods.run("pd", argv, env)
    url = f"http://{POD_IPS['pd']}:{value(argv, '--port')}"
    try:
        wait_healthy(url, proc, START_S, instance)
    except (RuntimeError, TimeoutError) as exc:
        pytest.fail(f"pd: {exc}\n{pods.log('pd')}")
    check_probes(container, url, objects)


def check_probes(container: dict[str, Any], url: str, objects: list[dict[str, Any]]) -> None:
    """Every probe's path and the Prometheus path answer 200 on the manifest's port (``url``'s)."""
    (template,) = [o["spec"]["template"] for o in objects if o["kind"] == "Deployment"
                   and container in o["spec"]["template"]["spec"]["containers"]]
    paths = {container[p]["httpGet"]["path"] for p in PROBES if p in container}
    paths.add(template["metadata"]["annotations"]["prometheus.io/path"])
    assert url.endswith(f":{template['metadata']['annotations']['prometheus.io/port']}")
    for path in sorted(paths):
        assert get(url + path) is not None, f"GET {url}{path} did not answer 200"


def admin_workers(router: str, token: str) -> list[dict[str, Any]]:
    request = urllib.request.Request(f"{router}/admin/workers", headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=10) as answer:
        return json.loads(answer.read())["workers"]
