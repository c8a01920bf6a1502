"""``stage env``'s output over faked facts: one screen of text however bad the machine, JSON with every
key a bug report needs, and never a Redis password (``safe_url``)."""

from __future__ import annotations

import json

import pytest

from stages.envcheck.facts import safe_url
from stages.envcheck.render import as_json, text
from stages.envcheck.verdict import verdicts
from tests.stages.envcheck.fakes import machine

pytestmark = pytest.mark.unit


def test_a_healthy_cpu_machine_reads_as_one_line_a_fact_and_ok_per_role():
    facts = machine(torch="cpu", redis=True)
    lines = text(facts, "auto", verdicts(facts)).splitlines()
    assert lines[0] == "epd-stage    0.1.0  python 3.11.7  Linux"
    assert lines[1] == "torch        2.13.0 (CPU build, transfer builds: cpu)"
    assert "GPUs         none visible (a CPU build of torch)" in lines
    assert "mooncake     mooncake-transfer-engine-non-cuda 0.3.13: imports; host memory only" in lines
    assert "UCX          self/memory tcp/lo (nixl_cu13.libs)" in lines
    assert "Redis        redis://:***@10.0.0.5:6379/0: answers PING" in lines
    assert lines[-4:] == ["device       auto -> cpu", "encoder      ok", "prefill      ok (via mooncake, nixl)",
                          "decode       ok (via mooncake, nixl)"]


def test_eight_gpus_and_every_role_failing_still_fit_one_screen():
    facts = machine(torch="cu12", gpus=8, mooncake_error="ImportError: libibverbs.so.1: cannot open", nixl=(),
                    redis=False)
    out = text(facts, "cuda:9", verdicts(facts))
    assert len(out.splitlines()) < 40
    assert "GPU 7        NVIDIA H100 80GB HBM3, 70.0 of 80.0 GiB free" in out
    assert "device       cuda:9 -> not here" in out
    assert out.count("NOT OK") == 3


def test_the_json_has_every_fact_and_verdict_and_round_trips():
    facts = machine(torch="cu12", gpus=1, redis=False)
    report = json.loads(json.dumps(as_json(facts, "auto", verdicts(facts))))
    assert {"stage", "python", "platform", "torch", "transformers", "backends", "ucx", "rdma", "redis", "device",
            "verdicts"} <= report.keys()
    assert report["torch"]["gpus"][0]["free_bytes"] == 70 << 30 and report["torch"]["driver"] == "570.1"
    assert report["device"] == {"asked": "auto", "resolved": "cuda:0", "problem": None}
    assert report["verdicts"]["encoder"]["ok"] is False and report["verdicts"]["decode"]["transfers"] == ["nixl"]
    assert [b["name"] for b in report["backends"]] == ["mooncake", "nixl"]


@pytest.mark.parametrize("url, shown", [
    ("redis://:s3cret@h:6379/0", "redis://:***@h:6379/0"),
    ("rediss://user:s3cret@h", "rediss://user:***@h"),
    ("unix:///run/redis.sock?db=0&password=s3cret", "unix:///run/redis.sock?db=0&password=***"),
    ("redis://h:6379", "redis://h:6379"),
    ("redis://user@h", "redis://user@h"),
])
def test_safe_url_hides_the_password_and_nothing_else(url, shown):
    assert safe_url(url) == shown
