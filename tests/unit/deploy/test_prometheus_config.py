"""deploy/: the Prometheus configuration, the alerting rules and the Grafana dashboard.

promtool (Debian's prometheus package, installed by .ci/system-deps.sh) checks
the configuration and the rules, runs the rules' unit tests, and checks every
dashboard query's PromQL (as recording rules); the dashboard is checked for
an importable shape and for metric names that exist (docs/metrics.md, itself
checked against the code).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from service.up.prometheus import (
    AGENT_JOB,
    COORDINATOR_JOB,
    RULES_FILE,
    render_config,
    write_targets,
)
from tests.support.dashboard import load_dashboard, metric_names, panels, queries

REPO = Path(__file__).resolve().parents[3]
PROMETHEUS_DIR = REPO / "deploy" / "prometheus"
METRICS_DOC = REPO / "docs" / "metrics.md"


@pytest.fixture
def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        pytest.skip("promtool is not on PATH: install Debian's prometheus package "
                    "(bash .ci/system-deps.sh; CI does)")
    return found


def run(promtool: str, *args: str, cwd: Path = PROMETHEUS_DIR) -> str:
    result = subprocess.run([promtool, *args], capture_output=True, text=True, timeout=60,
                            cwd=cwd, check=False)
    assert result.returncode == 0, f"promtool {' '.join(args)}:\n{result.stdout}{result.stderr}"
    return result.stdout + result.stderr


def documented_metrics() -> set[str]:
    return set(re.findall(r"^\| `(tidal_[a-z0-9_]+)`", METRICS_DOC.read_text(), re.MULTILINE))


def exposed_series(name: str, documented: set[str]) -> bool:
    """Whether ``name`` is a documented metric or one of a histogram's series."""
    if name in documented:
        return True
    base = re.sub(r"_(bucket|sum|count)$", "", name)
    return base != name and base in documented


def test_the_deploy_configuration_passes_promtool(promtool: str) -> None:
    out = run(promtool, "check", "config", "prometheus.yml")
    assert "1 rule files found" in out


def test_the_alerting_rules_pass_promtool_and_their_unit_tests(promtool: str) -> None:
    out = run(promtool, "check", "rules", RULES_FILE.name)
    assert "SUCCESS" in out
    run(promtool, "test", "rules", "tidal-alerts.test.yml")


def test_the_rules_use_only_documented_metrics() -> None:
    documented = documented_metrics()
    names = metric_names(RULES_FILE.read_text())
    assert names, "no tidal metric in the rules"
    assert {n for n in names if not exposed_series(n, documented)} == set()


def test_the_local_configuration_of_tidal_up_passes_promtool_and_matches_the_deploy_one(
    promtool: str, tmp_path: Path
) -> None:
    targets = tmp_path / "agents.json"
    write_targets(targets, ["127.0.0.1:9001", "127.0.0.1:9002", "127.0.0.1:9001"])
    assert json.loads(targets.read_text()) == [
        {"targets": ["127.0.0.1:9001", "127.0.0.1:9002"], "labels": {}}
    ]
    config = tmp_path / "prometheus.yml"
    config.write_text(render_config(coordinator="127.0.0.1:8470", agents_file=targets,
                                    scrape_interval_s=1, rule_files=[RULES_FILE]))
    run(promtool, "check", "config", str(config), cwd=tmp_path)
    deploy_jobs = re.findall(r"^  - job_name: (\S+)", (PROMETHEUS_DIR / "prometheus.yml")
                             .read_text(), re.MULTILINE)
    assert deploy_jobs == [COORDINATOR_JOB, AGENT_JOB]
    local_jobs = [job["job_name"] for job in json.loads(config.read_text())["scrape_configs"]]
    assert local_jobs == deploy_jobs


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


def test_every_dashboard_query_is_valid_promql_on_documented_metrics(
    promtool: str, tmp_path: Path
) -> None:
    documented = documented_metrics()
    rules = []
    for i, query in enumerate(queries(load_dashboard())):
        unknown = {n for n in metric_names(query.expr) if not exposed_series(n, documented)}
        assert not unknown, f"panel {query.panel!r} queries undocumented metrics {unknown}"
        rules.append({"record": f"dashboard:query_{i}", "expr": query.expr})
    path = tmp_path / "dashboard-rules.yml"
    path.write_text(json.dumps({"groups": [{"name": "dashboard", "rules": rules}]}))
    out = run(promtool, "check", "rules", str(path), cwd=tmp_path)
    assert f"{len(rules)} rules found" in out
