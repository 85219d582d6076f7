"""The web page's routes (service.ui): a fixed set of files, strict headers, and a
config route behind the API's token."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fastapi import Depends, FastAPI, Header, HTTPException
from fastapi.testclient import TestClient

from service.ui import ASSETS, GRAFANA_DASHBOARD_UID, grafana_dashboard_url, ui_router

ROOT = Path(__file__).resolve().parents[4]


def _client(grafana_url: str | None = None) -> TestClient:
    def auth(authorization: str | None = Header(default=None)) -> None:
        if authorization != "Bearer right":
            raise HTTPException(401, "missing or wrong bearer token")

    app = FastAPI()
    app.include_router(ui_router(auth=Depends(auth), grafana_url=grafana_url))
    return TestClient(app)


def test_ui_redirects_to_the_page_whose_relative_urls_need_the_slash():
    response = _client().get("/ui", follow_redirects=False)
    assert response.status_code == 308 and response.headers["location"] == "ui/"


@pytest.mark.parametrize("name", sorted(ASSETS))
def test_each_asset_is_served_with_a_policy_that_allows_only_this_origin(name: str):
    response = _client().get(f"/ui/{name}")
    assert response.status_code == 200
    policy = response.headers["content-security-policy"]
    assert "default-src 'none'" in policy and "script-src 'self'" in policy
    assert "unsafe" not in policy
    assert response.headers["x-content-type-options"] == "nosniff"
    assert response.headers["referrer-policy"] == "no-referrer"


@pytest.mark.parametrize("path", ["/ui/index.html", "/ui/static/app.js", "/ui/..%2f__init__.py",
                                  "/ui/app.js/x", "/ui/%2e%2e/%2e%2e/etc/passwd"])
def test_nothing_else_under_ui_is_served(path: str):
    assert _client().get(path).status_code == 404


def test_the_script_never_writes_markup_from_data():
    text = (ROOT / "service" / "ui" / "static" / "app.js").read_text()
    script = "\n".join(line for line in text.splitlines() if not line.strip().startswith("//"))
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(",
                 "new Function", "localStorage", "document.cookie"):
        assert sink not in script, sink


def test_the_config_needs_the_token_and_names_the_dashboard():
    client = _client("https://grafana.example/")
    assert client.get("/v1/ui/config").status_code == 401
    response = client.get("/v1/ui/config", headers={"Authorization": "Bearer right"})
    assert response.json() == {
        "grafana_dashboard_url": "https://grafana.example/d/tidal-overview/tidal"
    }
    assert grafana_dashboard_url(None) is None


def test_the_dashboard_uid_is_the_one_deploy_ships():
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "tidal.json").read_text())
    assert dashboard["uid"] == GRAFANA_DASHBOARD_UID
