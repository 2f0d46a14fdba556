"""deploy/prometheus/: the rules and the example config pass promtool's checks, and the rules' unit tests
(alerts_test.yml) pass: every alert fires on its made-up series and stays quiet on the others."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from harness.servers import REPO

DEPLOY = REPO / "deploy" / "prometheus"
ALERTS = DEPLOY / "alerts.yml"
ALERTS_TEST = DEPLOY / "alerts_test.yml"
CONFIG = DEPLOY / "prometheus.yml"
SLO_RECORD = "infercache:latency_slo_p99_seconds"

needs_promtool = pytest.mark.skipif(
    shutil.which("promtool") is None,
    reason="promtool not installed (make test installs it: apt-get install prometheus)")


def promtool(*args: str, cwd: Path) -> str:
    done = subprocess.run(["promtool", *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"promtool {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout + done.stderr


def rules() -> list[dict]:
    return [rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]]


@needs_promtool
def test_promtool_checks_the_rules():
    assert "SUCCESS" in promtool("check", "rules", str(ALERTS), cwd=REPO)


@needs_promtool
def test_promtool_checks_the_config_from_any_directory(tmp_path):
    # rule_files: [alerts.yml] is resolved against the config's directory, not the working directory
    out = promtool("check", "config", str(CONFIG), cwd=tmp_path)
    assert "1 rule files found" in out and "SUCCESS" in out


@needs_promtool
def test_the_rules_unit_tests_pass(tmp_path):
    assert "SUCCESS" in promtool("test", "rules", str(ALERTS_TEST), cwd=tmp_path)


@needs_promtool
def test_the_slo_is_configured_in_one_place(tmp_path):
    """A copy of alerts.yml with the SLO at 1 s: the p99 case that fires at 0.25 s (0.497 s) stays quiet."""
    text = ALERTS.read_text()
    assert text.count("vector(0.25)") == 1
    (tmp_path / "alerts.yml").write_text(text.replace("vector(0.25)", "vector(1)"))
    latency_case = next(case for case in yaml.safe_load(ALERTS_TEST.read_text())["tests"]
                        if any(t["alertname"] == "InfercacheLatencyP99OverSLO" for t in case.get("alert_rule_test", [])))
    case = {"interval": latency_case["interval"], "input_series": latency_case["input_series"],
            "promql_expr_test": [{"expr": SLO_RECORD, "eval_time": "20m",
                                  "exp_samples": [{"labels": SLO_RECORD, "value": 1}]}],
            "alert_rule_test": [{"alertname": "InfercacheLatencyP99OverSLO", "eval_time": "20m", "exp_alerts": []}]}
    (tmp_path / "test.yml").write_text(yaml.safe_dump(
        {"rule_files": ["alerts.yml"], "evaluation_interval": "1m", "tests": [case]}))
    assert "SUCCESS" in promtool("test", "rules", str(tmp_path / "test.yml"), cwd=tmp_path)


def test_every_alert_has_a_severity_a_summary_a_description_and_a_test():
    alerts = [rule for rule in rules() if "alert" in rule]
    assert len({a["alert"] for a in alerts}) == len(alerts) >= 6
    tested = {}
    for case in yaml.safe_load(ALERTS_TEST.read_text())["tests"]:
        for check in case.get("alert_rule_test", []):
            tested.setdefault(check["alertname"], []).append(bool(check.get("exp_alerts")))
    for alert in alerts:
        name = alert["alert"]
        assert alert["labels"]["severity"] in ("critical", "warning", "info"), name
        assert alert["annotations"]["summary"] and alert["annotations"]["description"], name
        assert True in tested.get(name, []), f"{name}: no test case where it fires"
        assert False in tested[name], f"{name}: no test case where it must stay quiet (exp_alerts: [])"


def test_the_slo_alert_compares_with_the_recorded_slo():
    by_name = {rule.get("record") or rule.get("alert"): rule for rule in rules()}
    assert re.fullmatch(r"vector\([0-9.]+\)", by_name[SLO_RECORD]["expr"].strip())
    assert f"on() group_left() {SLO_RECORD}" in by_name["InfercacheLatencyP99OverSLO"]["expr"]
    assert sum(1 for rule in rules() if rule.get("record") == SLO_RECORD) == 1
