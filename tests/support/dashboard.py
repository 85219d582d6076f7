"""The Grafana dashboard's queries, with Grafana's variables replaced, for tests to evaluate."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy" / "grafana" / "tidal.json"
# Grafana replaces these before a query reaches Prometheus.
VARIABLES = {"$__rate_interval": "30s", "$__interval": "15s", "$__range": "1h"}


@dataclass(frozen=True)
class PanelQuery:
    panel: str
    ref: str
    expr: str  # variables replaced: ready for Prometheus


def load_dashboard() -> dict[str, Any]:
    dashboard: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return dashboard


def panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel that queries, rows' nested panels included."""
    out = []
    for panel in dashboard["panels"]:
        out.extend(panel.get("panels", []))
        if panel.get("type") != "row":
            out.append(panel)
    return out


def queries(dashboard: dict[str, Any], *, job_id: str = ".*") -> list[PanelQuery]:
    """Every target's expression, with ``$job_id`` set to the regex ``job_id``."""
    out = []
    for panel in panels(dashboard):
        for target in panel.get("targets", []):
            expr = target["expr"]
            for name, value in VARIABLES.items():
                expr = expr.replace(name, value)
            expr = expr.replace("$job_id", job_id)
            assert "$" not in expr.replace("$labels", ""), f"unknown variable in {expr!r}"
            out.append(PanelQuery(panel["title"], target["refId"], expr))
    return out


def metric_names(expr: str) -> set[str]:
    return set(re.findall(r"\btidal_[a-z0-9_]+", expr))
