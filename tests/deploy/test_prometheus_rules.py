"""deploy/prometheus/rules.yml with Debian's promtool: ``check rules`` accepts it, ``test rules`` passes
rules.test.yml, whose cases hold every alert both firing and not firing, and fails when a rule's
threshold changes (a negative control: the unit tests can fail)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO
from tests.deploy.prometheus_server import tool

pytestmark = pytest.mark.timeout(120)
RULES_DIR = REPO / "deploy" / "prometheus"
ALERTS = ["EpdStageDown", "EpdNoHealthyWorker", "EpdWorkerUnhealthy", "EpdHighErrorRatio", "EpdCacheUnavailable",
          "EpdKvPoolNearlyFull", "EpdEncoderQueueGrowing", "EpdCircuitOpen"]


def promtool(*args: str, cwd: Path = RULES_DIR) -> subprocess.CompletedProcess:
    return subprocess.run([tool("promtool"), *args], cwd=cwd, capture_output=True, text=True, timeout=60)


def rules() -> list[dict]:
    groups = yaml.safe_load((RULES_DIR / "rules.yml").read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


@pytest.mark.unit
def test_a_missing_tool_fails_naming_the_setup_command(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(pytest.fail.Exception, match=r"^promtool is not installed: run `bash scripts/setup.sh test` "
                                                    r"\(Debian's prometheus package\)$"):
        tool("promtool")


def test_promtool_check_rules_accepts_every_rule():
    done = promtool("check", "rules", "rules.yml")
    assert (done.returncode, done.stdout) == (0, f"Checking rules.yml\n  SUCCESS: {len(rules())} rules found\n\n")


@pytest.mark.unit
def test_the_alerts_are_the_ones_the_issue_asks_for():
    assert [r["alert"] for r in rules() if "alert" in r] == ALERTS


def test_promtool_test_rules_passes():
    done = promtool("test", "rules", "rules.test.yml")
    assert (done.returncode, done.stdout.split()) == (0, ["Unit", "Testing:", "rules.test.yml", "SUCCESS"]), done.stdout


@pytest.mark.unit
def test_every_alert_is_tested_firing_and_not_firing():
    cases = [case for test in yaml.safe_load((RULES_DIR / "rules.test.yml").read_text())["tests"]
             for case in test.get("alert_rule_test", [])]
    firing = {c["alertname"] for c in cases if c["exp_alerts"]}
    quiet = {c["alertname"] for c in cases if not c["exp_alerts"]}
    assert (sorted(firing), sorted(quiet)) == (sorted(ALERTS), sorted(ALERTS))


@pytest.mark.parametrize("old, new, alert", [("epd:kv_pool_use:ratio > 0.9", "epd:kv_pool_use:ratio > 0.96",
                                              "EpdKvPoolNearlyFull"),
                                             ("epd_encoder_queue_depth > 8 and", "epd_encoder_queue_depth > 0 and",
                                              "EpdEncoderQueueGrowing")])
def test_a_changed_threshold_fails_the_unit_tests(tmp_path, old, new, alert):
    text = (RULES_DIR / "rules.yml").read_text()
    assert text.count(old) == 1
    (tmp_path / "rules.yml").write_text(text.replace(old, new))
    shutil.copy(RULES_DIR / "rules.test.yml", tmp_path)
    done = promtool("test", "rules", "rules.test.yml", cwd=tmp_path)
    assert done.returncode == 1
    assert f"alertname: {alert}," in done.stdout + done.stderr
