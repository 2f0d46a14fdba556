"""deploy/grafana/: the dashboard's structure, and deploy/grafana/queries.py filling in its variables.
(Running every panel's query against a real Prometheus scraping a real server is another test's.)"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess

import pytest
import yaml

from server.shared.telemetry import SCHEMA
from harness.servers import REPO

GRAFANA = REPO / "deploy" / "grafana"
DASHBOARD = json.loads((GRAFANA / "infercache.json").read_text())
ALERTS = REPO / "deploy" / "prometheus" / "alerts.yml"

_spec = importlib.util.spec_from_file_location("grafana_queries", GRAFANA / "queries.py")
queries = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(queries)

# what the server exposes (histograms also as _bucket, _sum, _count): every series is named in the schema
METRICS = set(SCHEMA)
WITHOUT_QUERIES = {"row", "text"}


def all_panels() -> list[dict]:
    return list(queries.panels(DASHBOARD))


def test_every_panel_has_a_unique_id_a_place_and_queries():
    panels = all_panels()
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "duplicate panel ids"
    for panel in panels:
        grid = panel["gridPos"]
        assert {"h", "w", "x", "y"} <= grid.keys() and grid["w"] > 0 and grid["h"] > 0, panel["title"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        assert panel.get("title"), panel["id"]
        if panel["type"] in WITHOUT_QUERIES:
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["expr"].strip(), panel["title"]
            assert target["datasource"]["uid"] == "${DS_PROMETHEUS}", panel["title"]
        assert len({t["refId"] for t in panel["targets"]}) == len(panel["targets"]), panel["title"]


def test_no_two_panels_overlap():
    cells = {}
    for panel in all_panels():
        g = panel["gridPos"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{panel['title']!r} overlaps {cells[(x, y)]!r}"
                cells[(x, y)] = panel["title"]


def test_the_datasource_and_model_variables():
    variables = {v["name"]: v for v in DASHBOARD["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource" and variables["DS_PROMETHEUS"]["query"] == "prometheus"
    model = variables["model"]
    assert model["type"] == "query" and model["datasource"]["uid"] == "${DS_PROMETHEUS}"
    assert model["query"]["query"] == model["definition"] == "label_values(infercache_requests_total, model)"
    assert model["includeAll"] and model["allValue"] == ".*"
    assert 36 <= DASHBOARD["schemaVersion"] <= 41


def test_the_panels_cover_what_operators_look_at():
    titles = " | ".join(p["title"].lower() for p in all_panels())
    for words in ("hit ratio per tier", "time saved", "p50", "p99", "miss reasons", "batch size", "queue depth",
                  "store size against budget", "engine builds", "restarts", "refused", "hot keys"):
        assert words in titles, words
    hot = next(p for p in all_panels() if p["title"] == "Hot keys")
    assert "infercache cache hot --model" in hot["options"]["content"]


def test_panel_queries_fill_in_every_variable():
    found = queries.panel_queries(DASHBOARD)
    expected = sum(len(p.get("targets", [])) for p in all_panels())
    assert len(found) == expected >= 20
    for title, expr in found:
        assert "$" not in expr and "[[" not in expr, (title, expr)
    raw = " ".join(t["expr"] for p in all_panels() for t in p.get("targets", []))
    assert "$model" in raw and "$__rate_interval" in raw and "$__range" in raw  # there was something to fill in
    exprs = " ".join(expr for _, expr in found)
    assert 'model=~".*"' in exprs and "[1m]" in exprs and "[1h]" in exprs
    only = " ".join(e for _, e in queries.panel_queries(DASHBOARD, "minilm|faq", range_="6h"))
    assert 'model=~"minilm|faq"' in only and "[6h]" in only and 'model=~".*"' not in only


def test_substitute():
    values = queries.builtins("2m", "30s", "6h") | {"model": "a|b"}
    assert queries.substitute("x{m=~\"${model:regex}\"}[$__rate_interval] [[model]] $__range_s $__interval_ms"
                              " $__range_ms $__range $__interval $unknown", values) == \
        'x{m=~"a|b"}[2m] a|b 21600 30000 21600000 6h 30s $unknown'


def test_queries_name_only_metrics_the_server_exposes():
    recorded = {r["record"] for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"] if "record" in r}
    for title, expr in queries.panel_queries(DASHBOARD):
        for name in re.findall(r"\binfercache[:_][\w:]*", expr):
            base = re.sub(r"_(bucket|sum|count)$", "", name)
            assert name in METRICS or base in METRICS or name in recorded, (title, name)


@pytest.mark.skipif(shutil.which("promtool") is None,
                    reason="promtool not installed (make test installs it: apt-get install prometheus)")
def test_every_query_parses(tmp_path):
    """promtool parses each filled-in query as a recording rule's expression: PromQL syntax, offline."""
    rules = [{"record": f"dashboard:query_{i}", "expr": expr}
             for i, (_, expr) in enumerate(queries.panel_queries(DASHBOARD))]
    (tmp_path / "queries.yml").write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    done = subprocess.run(["promtool", "check", "rules", str(tmp_path / "queries.yml")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
