"""A real Prometheus (deploy/prometheus/prometheus.yml with rules.yml, 1 s intervals) scraping a real
``stage up`` EPD stack (encoder, prefill, decode, router, embedded Redis) after a little traffic
through the official client: text and image requests, streamed and not, one image sent twice so
the cache hits. Then, through Prometheus's HTTP API: every target is up, every metric that a
dashboard query or a rule names exists as a series, every dashboard query (``$__rate_interval``
substituted) and every recording rule returns data, the rules loaded healthy, and the traffic is
what the series say (two images encoded, the repeated one a cache hit). Alerts are held to their
behaviour by promtool (tests/deploy/test_prometheus_rules.py), not by firing here. And
scrape-kubernetes.yml's relabelling, on targets carrying Kubernetes pod discovery's labels (Debian's
Prometheus has no Kubernetes discovery), finds each annotated server and labels its role."""

from __future__ import annotations

import json
import math
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import yaml

from tests.conftest import REPO
from tests.deploy.prometheus_server import Prometheus, tool
from tests.deploy.promql_names import metric_names
from tests.support.router_helpers import data_url, png
from tests.support.stage_up import Up

pytestmark = pytest.mark.timeout(600)
STARTUP_S = 240.0
SCRAPED_S = 60.0  # every wait on Prometheus (targets up, counters seen, rules evaluated)
RATE_INTERVAL = "5m"  # for $__rate_interval (4 s at a 1 s scrape): holds all the traffic, even on a slow machine
CONFIG = REPO / "deploy" / "prometheus"
DASHBOARD = REPO / "deploy" / "grafana" / "epd-dashboard.json"
ROLES = ["encoder", "prefill", "decode", "router"]
REQUESTS = 5  # what traffic() sends


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, query with Grafana's variables substituted) of every dashboard query."""
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [(p["title"], t["expr"].replace("$__rate_interval", RATE_INTERVAL))
            for p in panels for t in p.get("targets", [])]


def rules() -> list[dict]:
    return [r for g in yaml.safe_load((CONFIG / "rules.yml").read_text())["groups"] for r in g["rules"]]


def wait_for(what: str, check, within_s: float = SCRAPED_S):
    """``check()`` until it returns something true; AssertionError naming ``what`` after ``within_s``."""
    deadline = time.monotonic() + within_s
    while not (result := check()):
        assert time.monotonic() < deadline, f"{what}: not within {within_s} s"
        time.sleep(0.25)
    return result


@pytest.fixture(scope="module")
def stack(tiny_model, tmp_path_factory) -> Iterator[Up]:
    tool("prometheus")  # fail before the slow start when it is missing
    up = Up("--model", str(tiny_model("qwen2_vl")), "--port", "0", "--kv-cache-mib", "16",
            log_dir=tmp_path_factory.mktemp("up") / "logs")
    try:
        up.wait_line("stage up: ready: ", STARTUP_S)
        assert list(up.children()) == ROLES
        yield up
        up.proc.send_signal(signal.SIGTERM)
        assert up.finish(60)[0] == 0
    finally:
        up.kill()


@pytest.fixture(scope="module")
def prometheus(stack, tmp_path_factory) -> Iterator[Prometheus]:
    """deploy/prometheus/prometheus.yml at 1 s intervals, its targets file naming each server's role."""
    workdir = tmp_path_factory.mktemp("prometheus")
    shutil.copy(CONFIG / "rules.yml", workdir)
    (workdir / "targets").mkdir()
    (workdir / "targets" / "epd.json").write_text(json.dumps([
        {"targets": [f"127.0.0.1:{port}"], "labels": {"role": role}} for role, (port, _) in stack.children().items()]))
    config = yaml.safe_load((CONFIG / "prometheus.yml").read_text())
    config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"}
    server = Prometheus(config, workdir)
    try:
        server.start()
        wait_for("every target up", lambda: len([s for s in server.query("up == 1")]) == len(ROLES))
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def traffic(stack, prometheus) -> Prometheus:
    """REQUESTS requests through the router, then Prometheus has scraped them and evaluated the rules."""
    router = f"http://127.0.0.1:{stack.children()['router'][0]}"
    client = openai.OpenAI(base_url=f"{router}/v1", api_key="x", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    first, second = (data_url(png(48, 32, seed)) for seed in (1, 2))
    for image, stream in ((None, False), (None, True), (first, False), (first, True), (second, True)):
        parts = [{"type": "image_url", "image_url": {"url": image}}] if image else []
        messages = [{"role": "user", "content": [*parts, {"type": "text", "text": "Say something."}]}]
        reply = client.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0,
                                               stream=stream, extra_body={"ignore_eos": True})
        if stream:
            assert "".join(c.choices[0].delta.content or "" for c in reply if c.choices) != ""
        else:
            assert reply.usage.completion_tokens == 6
    client.close()
    success = 'sum(epd_router_requests_total{outcome="success"})'
    wait_for(f"{success} == {REQUESTS}",
             lambda: [float(s["value"][1]) for s in prometheus.query(success)] == [REQUESTS])
    for record in dict.fromkeys(r["record"] for r in rules() if "record" in r):
        wait_for(f"recorded {record}", lambda: prometheus.query(record))
    return prometheus


def test_every_target_is_up_with_its_role(traffic):
    assert sorted((s["metric"]["role"], s["value"][1]) for s in traffic.query("up")) == [
        (role, "1") for role in sorted(ROLES)]


def test_every_metric_named_by_the_dashboard_or_a_rule_exists(traffic):
    names = {n for _, query in dashboard_queries() for n in metric_names(query)}
    names |= {n for rule in rules() for n in metric_names(rule["expr"])}
    assert len(names) > 30
    assert sorted(n for n in names if not traffic.series(n)) == []


def numbers(samples: list[dict]) -> list[float]:
    """The values that are numbers (a quantile or a ratio of nothing observed is NaN: no data)."""
    return [v for v in (float(s["value"][1]) for s in samples) if not math.isnan(v)]


def test_every_dashboard_query_returns_data(traffic):
    assert traffic.query("epd_no_such_metric") == [] and traffic.series("epd_no_such_metric") == []  # can fail
    assert [(title, query) for title, query in dashboard_queries() if not numbers(traffic.query(query))] == []


def test_every_recording_rule_returns_data_and_is_recorded(traffic):
    records = [r for r in rules() if "record" in r]
    assert [r["record"] for r in records if not numbers(traffic.query(r["expr"]))] == []
    assert [r["record"] for r in records if not numbers(traffic.query(r["record"]))] == []
    loaded = {g["name"]: [(r["name"], r["health"]) for r in g["rules"]] for g in traffic.api("rules")["groups"]}
    assert loaded == {g["name"]: [(r.get("record") or r["alert"], "ok") for r in g["rules"]]
                      for g in yaml.safe_load((CONFIG / "rules.yml").read_text())["groups"]}


def test_the_series_tell_what_the_traffic_did(traffic):
    def value(expr: str) -> float:
        (sample,) = traffic.query(expr)
        return float(sample["value"][1])

    assert value("sum(epd_encoder_images_encoded_total)") == 2  # the repeated image was not encoded again
    assert value('sum(epd_router_images_total{cache="hit"})') == 1
    assert value('sum(epd_router_images_total{cache="miss"})') == 2
    assert value("sum(epd_router_time_to_first_token_seconds_count)") == 3  # the streamed ones
    assert value("sum(epd_router_e2e_request_latency_seconds_count)") == REQUESTS
    assert value("sum(epd_kv_transfer_writes)") > 0 and value("sum(epd_kv_transfer_bytes)") > 0
    assert 0 < value("epd:cache_hit:ratio_5m") < 1


def kubernetes_pods(stack: Up) -> list[dict]:
    """What Kubernetes pod discovery would give for the stack's servers: each at its pod address with
    a wrong port (the first declared containerPort; the annotation names the metrics port), its
    annotations and component label; plus Redis, not annotated for scraping."""
    def pod(role: str, annotations: dict[str, str]) -> dict:
        meta = {f"__meta_kubernetes_pod_annotation_{k}": v for k, v in annotations.items()}
        return {"targets": ["127.0.0.1:1"], "labels": {**meta, "__meta_kubernetes_namespace": "epd",
                                                       "__meta_kubernetes_pod_name": f"epd-{role}-0",
                                                       "__meta_kubernetes_pod_label_app_kubernetes_io_component": role}}
    scraped = {"prometheus_io_scrape": "true", "prometheus_io_path": "/metrics"}
    return [pod(role, {**scraped, "prometheus_io_port": str(port)})
            for role, (port, _) in stack.children().items()] + [pod("redis", {})]


def test_the_kubernetes_scrape_job_finds_annotated_pods_and_labels_their_role(stack, tmp_path):
    """scrape-kubernetes.yml's job, its kubernetes_sd_configs swapped for files of the same labels."""
    config = yaml.safe_load((CONFIG / "scrape-kubernetes.yml").read_text())
    (job,) = config["scrape_configs"]
    assert job.pop("kubernetes_sd_configs") == [{"role": "pod"}]
    job["file_sd_configs"] = [{"files": ["pods/*.json"]}]
    job["metrics_path"] = "/wrong"  # only the prometheus.io/path annotation can make the scrapes work
    config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"}
    shutil.copy(CONFIG / "rules.yml", tmp_path)
    (tmp_path / "pods").mkdir()
    (tmp_path / "pods" / "epd.json").write_text(json.dumps(kubernetes_pods(stack)))
    server = Prometheus(config, tmp_path)
    try:
        server.start()
        wait_for("every annotated pod up", lambda: len(server.query("up == 1")) == len(ROLES))
        targets = server.api("targets")
        assert sorted((t["scrapeUrl"], t["labels"]) for t in targets["activeTargets"]) == sorted(
            (f"http://127.0.0.1:{port}/metrics", {"instance": f"127.0.0.1:{port}", "job": "epd", "namespace": "epd",
                                                  "pod": f"epd-{role}-0", "role": role})
            for role, (port, _) in stack.children().items())
        dropped = [t["discoveredLabels"]["__meta_kubernetes_pod_name"] for t in targets["droppedTargets"]]
        assert dropped == ["epd-redis-0"]
    finally:
        server.stop()
