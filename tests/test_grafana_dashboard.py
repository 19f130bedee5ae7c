"""Issue 53: `infra/grafana/vlbatch.json` is a Grafana dashboard whose queries name only vlbatch's series
as Ray's Prometheus endpoint shows them (`SERIES`: the names tests/test_metrics_busy.py scrapes from a
real run and requires), tagged only with the tags vlbatch records."""
from __future__ import annotations

import json
import re
from pathlib import Path

from vlbatch.pipeline.telemetry.metrics import SERIES, TAG_KEYS

DASHBOARD = Path(__file__).resolve().parents[1] / "infra" / "grafana" / "vlbatch.json"
# PromQL words that are no series: functions, aggregations, keywords
PROMQL = {"sum", "by", "rate", "avg", "histogram_quantile", "label_values", "without", "max", "min", "irate",
          "increase", "count", "on", "ignoring"}
LABELS = {*TAG_KEYS, "stage", "kind", "error_type", "flag", "result", "le", "WorkerId", "NodeAddress"}


def _exprs(dash: dict) -> list[str]:
    out = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    out += [v["query"]["query"] for v in dash["templating"]["list"] if v["type"] == "query"]
    return out


def test_the_dashboard_is_a_valid_grafana_dashboard():
    dash = json.loads(DASHBOARD.read_text())
    assert isinstance(dash["uid"], str) and dash["uid"] and isinstance(dash["title"], str) and dash["title"]
    assert isinstance(dash["schemaVersion"], int) and dash["schemaVersion"] >= 30
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)) >= 6
    for p in dash["panels"]:
        assert p["type"] in ("timeseries", "stat", "gauge") and p["title"]
        assert {"h", "w", "x", "y"} <= set(p["gridPos"]) and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
        assert p["targets"] and all(t["expr"].strip() and t["refId"] for t in p["targets"])
    titles = " ".join(p["title"].lower() for p in dash["panels"])
    for wanted in ("rows/s by stage", "tokens/s", "busy fraction", "errors", "cache hit rate"):
        assert wanted in titles, wanted
    assert {v["name"] for v in dash["templating"]["list"]} >= {"datasource", "job", "run_id"}


def test_every_query_names_only_series_the_metrics_test_scrapes():
    dash = json.loads(DASHBOARD.read_text())
    for expr in _exprs(dash):
        bare = re.sub(r'\{[^}]*\}|"[^"]*"|\[[^\]]*\]', " ", expr)  # label matchers, strings, ranges out
        words = set(re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", bare)) - PROMQL - LABELS
        assert words and words <= set(SERIES), (expr, words - set(SERIES))
        for matcher in re.findall(r"\{([^}]*)\}", expr):
            names = set(re.findall(r"([A-Za-z_]+)\s*=~?", matcher))
            assert names <= LABELS, (expr, names - LABELS)
