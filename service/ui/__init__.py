"""The coordinator's web page for jobs, at ``/ui/``.

The page is a static shell (HTML, one script, one style sheet) with no data
in it: it asks for the API token, keeps it in the tab's ``sessionStorage``
and reads everything through the same ``/v1`` API the CLI uses, with a bearer
header. So the page is open and the data is not: the shell and its assets are
served without a credential, and every call the script makes needs the token.

``ui_router`` builds the routes; ``create_app`` includes them. The files are
named here, one by one: a request path never becomes a file path. Every
answer carries a Content-Security-Policy that allows only this origin's own
script and style (no inline script, no ``eval``, no other site), so a value
that slipped past the script's escaping still could not run.
"""

from __future__ import annotations

from importlib import resources
from typing import Any

from fastapi import APIRouter, params
from fastapi.responses import RedirectResponse, Response
from pydantic import BaseModel

#: The uid of deploy/grafana/tidal.json (a test keeps the two the same).
GRAFANA_DASHBOARD_UID = "tidal-overview"
GRAFANA_DASHBOARD_SLUG = "tidal"

#: What the page may load and call: its own origin only. No inline script or
#: style, no frames, no form posting elsewhere, no <base> rewriting.
CONTENT_SECURITY_POLICY = "; ".join([
    "default-src 'none'",
    "script-src 'self'",
    "style-src 'self'",
    "img-src 'self' data:",
    "connect-src 'self'",
    "base-uri 'none'",
    "form-action 'self'",
    "frame-ancestors 'none'",
])
HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    # The shell changes with the version; a stale script against a newer API
    # would mislead, and the files are small.
    "Cache-Control": "no-cache",
}

#: The files the page is made of: URL name -> (file in static/, media type).
ASSETS: dict[str, tuple[str, str]] = {
    "": ("index.html", "text/html; charset=utf-8"),
    "app.js": ("app.js", "text/javascript; charset=utf-8"),
    "app.css": ("app.css", "text/css; charset=utf-8"),
}


class UiConfig(BaseModel):
    """``GET /v1/ui/config``: what the page needs beyond the jobs API."""

    grafana_dashboard_url: str | None = None


def grafana_dashboard_url(grafana_url: str | None) -> str | None:
    """The tidal dashboard's address on the Grafana at ``grafana_url`` (or None).

    The page adds ``?var-job_id=<job>`` for one job's panels.
    """
    if not grafana_url:
        return None
    return f"{grafana_url.rstrip('/')}/d/{GRAFANA_DASHBOARD_UID}/{GRAFANA_DASHBOARD_SLUG}"


def _asset(name: str) -> bytes:
    return (resources.files(__package__) / "static" / name).read_bytes()


def ui_router(*, auth: params.Depends, grafana_url: str | None = None) -> APIRouter:
    """The page's routes: ``/ui`` (redirects), ``/ui/``, its two assets, and
    ``/v1/ui/config`` (behind ``auth``, like every /v1 route).

    Args:
        auth: the API's bearer-token dependency.
        grafana_url: the Grafana that shows tidal's dashboard, for the page's
            links; None leaves them out.
    """
    router = APIRouter()
    config = UiConfig(grafana_dashboard_url=grafana_dashboard_url(grafana_url))
    files = {name: (_asset(file), media) for name, (file, media) in ASSETS.items()}

    @router.get("/ui", include_in_schema=False)
    async def ui_root() -> Response:
        # Relative URLs in the page (its assets, ../v1/) need the trailing slash.
        return RedirectResponse("ui/", status_code=308, headers=HEADERS)

    def serve(name: str) -> Any:
        body, media = files[name]

        async def asset() -> Response:
            return Response(body, media_type=media, headers=HEADERS)

        return asset

    for name in ASSETS:
        router.add_api_route(f"/ui/{name}", serve(name), methods=["GET"],
                             include_in_schema=False)

    @router.get("/v1/ui/config", dependencies=[auth], tags=["ui"])
    async def ui_config() -> UiConfig:
        """Settings the web page uses (the Grafana dashboard's address, if configured)."""
        return config

    return router
