"""deploy/: promtool (Debian's prometheus package, installed by .ci/system-deps.sh) checks
the Prometheus configuration (the deploy one and the one `tidal up` writes) and the rules,
runs the rules' unit tests, and checks every dashboard query's PromQL (as recording rules).
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
from tests.support.dashboard import load_dashboard, metric_names, queries
from tests.unit.deploy.test_prometheus_config import (
    PROMETHEUS_DIR,
    documented_metrics,
    exposed_series,
)


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


def test_the_deploy_configuration_passes_promtool(promtool: str) -> None:
    out = run(promtool, "check", "config", "prometheus.yml")
    assert "1 rule files found" in out


def test_the_alerting_rules_pass_promtool_and_their_unit_tests(promtool: str) -> None:
    out = run(promtool, "check", "rules", RULES_FILE.name)
    assert "SUCCESS" in out
    run(promtool, "test", "rules", "tidal-alerts.test.yml")


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
