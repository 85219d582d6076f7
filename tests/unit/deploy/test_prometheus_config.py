"""deploy/: the alerting rules and the Grafana dashboard use only metrics that exist
(docs/metrics.md, itself checked against the code), and the dashboard has an importable
shape. promtool's checks of the same files are tests/integration/deploy/test_promtool.py.
"""

from __future__ import annotations

import re
from pathlib import Path

from service.up.prometheus import RULES_FILE
from tests.support.dashboard import load_dashboard, metric_names, panels

REPO = Path(__file__).resolve().parents[3]
PROMETHEUS_DIR = REPO / "deploy" / "prometheus"
METRICS_DOC = REPO / "docs" / "metrics.md"


def documented_metrics() -> set[str]:
    return set(re.findall(r"^\| `(tidal_[a-z0-9_]+)`", METRICS_DOC.read_text(), re.MULTILINE))


def exposed_series(name: str, documented: set[str]) -> bool:
    """Whether ``name`` is a documented metric or one of a histogram's series."""
    if name in documented:
        return True
    base = re.sub(r"_(bucket|sum|count)$", "", name)
    return base != name and base in documented


def test_the_rules_use_only_documented_metrics() -> None:
    documented = documented_metrics()
    names = metric_names(RULES_FILE.read_text())
    assert names, "no tidal metric in the rules"
    assert {n for n in names if not exposed_series(n, documented)} == set()


def test_the_dashboard_is_importable_with_a_datasource_variable() -> None:
    dashboard = load_dashboard()
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert metric_names(variables["job_id"]["definition"]) <= documented_metrics()
    assert dashboard["uid"] and dashboard["title"] and dashboard["schemaVersion"] >= 30
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in panels(dashboard):
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"], f"panel {panel['title']!r} has no query"
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]
    titles = {p["title"] for p in panels(dashboard)}
    for needed in ("Jobs by phase", "World size per job", "Throughput per job",
                   "Restarts by reason", "Recovery duration (mean over 30m)", "Checkpoint age",
                   "Checkpoint save and training stall", "Node health"):
        assert needed in titles
