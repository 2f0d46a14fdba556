"""harness/prometheus_server.py against a real prometheus process that scrapes its own /metrics
(no infercache server needed) and evaluates deploy/prometheus/alerts.yml."""

from __future__ import annotations

import time

import pytest

from harness import prometheus_server
from harness.servers import REPO, free_port
from harness.prometheus_server import PrometheusError, PrometheusProcess, sample_value

pytestmark = pytest.mark.skipif(prometheus_server.available() is not None,
                                reason=prometheus_server.available() or "")

ALERTS = REPO / "deploy" / "prometheus" / "alerts.yml"


@pytest.fixture(scope="module")
def prom(tmp_path_factory):
    port = free_port()
    server = PrometheusProcess(tmp_path_factory.mktemp("prom"), [f"127.0.0.1:{port}"], job="self", port=port,
                               rule_files=[ALERTS])
    try:
        yield server
    finally:
        server.stop()


def test_it_scrapes_itself_every_second(prom):
    up = prom.wait_for('up{job="self"}', lambda r: len(r) == 1 and sample_value(r[0]) == 1.0, timeout=15)
    assert up[0]["metric"]["instance"] == f"127.0.0.1:{prom.port}"
    # two scrapes a second or so apart: the scrape interval is 1 s
    prom.wait_for('count_over_time(up{job="self"}[1m])', lambda r: r and sample_value(r[0]) >= 2, timeout=10)
    assert [t["health"] for t in prom.targets()] == ["up"]


def test_query_range_and_errors(prom):
    prom.wait_for('up{job="self"}', lambda r: r and sample_value(r[0]) == 1.0, timeout=15)
    now = time.time()
    series = prom.query_range('up{job="self"}', now - 5, now, 1)
    assert len(series) == 1 and series[0]["values"] and all(v == "1" for _, v in series[0]["values"])
    assert prom.query("1 + 1") == [{"metric": {}, "value": [pytest.approx(time.time(), abs=30), "2"]}]
    assert prom.query("no_such_metric_anywhere") == []
    with pytest.raises(PrometheusError, match="bad_data"):
        prom.query("sum(")


def test_it_evaluates_the_rule_files(prom):
    # the SLO is a constant recording rule: recorded from the first evaluation on, with no infercache data
    slo = prom.wait_for("infercache:latency_slo_p99_seconds", lambda r: len(r) == 1, timeout=15)
    assert sample_value(slo[0]) == 0.25
    assert prom.query('ALERTS{alertstate="firing"}') == []


def test_available_says_why(monkeypatch):
    monkeypatch.setattr(prometheus_server.shutil, "which", lambda name: None)
    assert "apt-get install prometheus" in prometheus_server.available()
