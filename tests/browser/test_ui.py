"""The coordinator's web page (/ui/) in a real headless chromium, against a real
coordinator and real agents.

* signing in: a wrong token is refused and shows nothing; the right one shows
  the jobs, and a job submitted meanwhile appears; the nodes page shows a
  node's GPUs, a failed one with its fault;
* a job's page: a resize by the API shows up as the new world size, an event
  with its recovery's duration, and a change in the chart; its logs stream;
  the Grafana link names the job; a failed job's page shows its error; the
  nodes page lists the nodes and their jobs;
* never in the page, at any point: the token, or a value of a job's environment.

``TIDAL_UI_SCREENSHOTS=DIR`` saves the jobs table and the job page as
``DIR/ui-jobs.png`` and ``DIR/ui-job.png`` (docs/ holds the ones the README shows).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from rendezvous.etcd.server import EtcdServer
from tests.support.agents import AgentCluster
from tests.support.coordinator import (
    TOKEN,
    CoordinatorProcess,
    coordinator_and_agents,
    job_spec,
    job_view,
)
from tests.support.processes import ProcessGroupRegistry
from tests.support.wait import wait_for

STEPPER = Path(__file__).with_name("stepper.py")
INDEX = Path(__file__).resolve().parents[2] / "service" / "ui" / "static" / "index.html"
SECRET = "s3cret-value-that-must-never-show"
GRAFANA = "http://grafana.example:3000"
SCREENSHOTS = os.environ.get("TIDAL_UI_SCREENSHOTS")


@pytest.fixture
def cluster(
    tmp_path: Path, etcd_server: EtcdServer, etcd_root: str, procs: ProcessGroupRegistry
) -> Iterator[tuple[CoordinatorProcess, AgentCluster]]:
    with coordinator_and_agents(
        tmp_path=tmp_path, etcd_server=etcd_server, etcd_root=etcd_root, procs=procs,
        coordinator_flags=("--grafana-url", GRAFANA),
    ) as both:
        yield both


# helpers --------------------------------------------------------------------------------

_EVERYTHING_SHOWN = """
return [document.documentElement.outerHTML, document.body.innerText, document.title,
        location.href, document.cookie, window.name,
        ...Array.from(document.querySelectorAll('input, textarea')).map(e => e.value)].join('\\n');
"""


def assert_nothing_secret(driver: Any) -> None:
    """Neither the token nor the job's secret is anywhere in the page or its URL."""
    shown = driver.page_source + "\n" + driver.execute_script(_EVERYTHING_SHOWN)
    for secret in (TOKEN, SECRET):
        assert secret not in shown, f"{secret[:6]}... is in the page"
    assert TOKEN not in driver.current_url


def assert_no_script_errors(driver: Any) -> None:
    """No script error or Content-Security-Policy violation in the browser's console
    (a refused fetch, a 401 for the wrong token or a 404, is not one)."""
    errors = [e["message"] for e in driver.get_log("browser")
              if e["level"] == "SEVERE" and "Failed to load resource" not in e["message"]]
    assert errors == []


def text_of(driver: Any, selector: str) -> str:
    """The rendered text of the first element ``selector`` matches, read in one
    script (the page re-renders every 2 s: an element held across calls may go)."""
    text = driver.execute_script(
        "const e = document.querySelector(arguments[0]); return e ? e.innerText : null;", selector)
    if text is None:
        raise LookupError(f"nothing matches {selector}")
    return str(text)


def shown(driver: Any, selector: str) -> bool:
    return bool(driver.execute_script(
        "const e = document.querySelector(arguments[0]); return !!e && e.checkVisibility();",
        selector))


def click(driver: Any, selector: str) -> None:
    """Click the element ``selector`` matches, once it is there."""
    wait_for(lambda: driver.execute_script(
        "const e = document.querySelector(arguments[0]); if (e) e.click(); return !!e;",
        selector), timeout=15, what=f"{selector} to click")


def sign_in(driver: Any, token: str) -> None:
    from selenium.webdriver.common.by import By

    wait_for(lambda: shown(driver, "#token"), timeout=10, what="the sign-in form")
    field = driver.find_element(By.CSS_SELECTOR, "#token")
    field.clear()
    field.send_keys(token)
    driver.find_element(By.CSS_SELECTOR, "#sign-in").click()


def job_row(driver: Any, job_id: str) -> dict[str, str] | None:
    """The jobs table's row for ``job_id`` as {column: text}, or None."""
    return driver.execute_script(  # type: ignore[no-any-return]
        """
        const row = document.querySelector('#jobs tr[data-job="' + CSS.escape(arguments[0]) + '"]');
        if (!row) return null;
        const names = Array.from(document.querySelectorAll('#jobs thead th'))
          .map(th => th.innerText);
        return Object.fromEntries(Array.from(row.cells).map((td, i) => [names[i], td.innerText]));
        """,
        job_id,
    )


def summary(driver: Any) -> dict[str, str]:
    """The job page's summary as {label: text}."""
    return driver.execute_script(  # type: ignore[no-any-return]
        """
        const out = {};
        for (const dt of document.querySelectorAll('#job-summary dt'))
          out[dt.innerText] = dt.nextElementSibling.innerText;
        return out;
        """
    )


def events_shown(driver: Any) -> list[dict[str, str]]:
    return driver.execute_script(  # type: ignore[no-any-return]
        """
        return Array.from(document.querySelectorAll('#events-table tbody tr')).map(row => ({
          reason: row.dataset.reason, world: row.cells[4].innerText,
          recovery: row.cells[5].innerText}));
        """
    )


def chart_steps(driver: Any) -> list[int]:
    """The world sizes the chart steps through, in order."""
    sizes = driver.execute_script(
        "const c = document.querySelector('#world-size-chart svg');"
        "return c ? c.dataset.sizes : '';")
    return [int(size) for size in sizes.split(",") if size]


def logs_route_exists(url: str) -> bool:
    paths = httpx.get(f"{url}/openapi.json", timeout=10).json()["paths"]
    return "/v1/jobs/{job_id}/logs" in paths


@contextlib.contextmanager
def explained(driver: Any, cluster: tuple[CoordinatorProcess, AgentCluster], api: httpx.Client,
              job_ids: list[str]) -> Iterator[None]:
    """On failure, print what the page and the API showed, and the processes' logs."""
    try:
        yield
    except BaseException:
        coordinator, agents = cluster
        with contextlib.suppress(Exception):
            print("the page:", driver.execute_script("return document.body.innerText"))
        for job_id in job_ids:
            with contextlib.suppress(Exception):
                print("the API's view:", job_view(api, job_id))
                print("its events:", api.get(f"/v1/jobs/{job_id}/events").json())
        print(coordinator.log_tail(), agents.log_tails(), sep="\n")
        raise


def screenshot(driver: Any, name: str) -> None:
    if SCREENSHOTS:
        Path(SCREENSHOTS).mkdir(parents=True, exist_ok=True)
        height = driver.execute_script("return document.documentElement.scrollHeight")
        driver.set_window_size(1280, max(900, min(int(height) + 40, 2400)))
        driver.save_screenshot(str(Path(SCREENSHOTS) / name))
        driver.set_window_size(1280, 900)


# tests ----------------------------------------------------------------------------------


@pytest.mark.timeout(180)
def test_sign_in_refuses_a_wrong_token_then_shows_jobs_as_they_appear(
    tmp_path: Path, browser: Any, cluster: tuple[CoordinatorProcess, AgentCluster]
):
    api = cluster[0].client()
    job_ids: list[str] = []
    with explained(browser, cluster, api, job_ids):
        _sign_in_scenario(tmp_path, *cluster, api, browser, job_ids)


def _sign_in_scenario(tmp_path: Path, coordinator: CoordinatorProcess, agents: AgentCluster,
                      api: httpx.Client, driver: Any, job_ids: list[str]) -> None:
    # The shell is open and holds no data; what the page reads needs the token.
    assert httpx.get(f"{coordinator.url}/ui/", timeout=10).text == INDEX.read_text()
    assert httpx.get(f"{coordinator.url}/v1/ui/config", timeout=10).status_code == 401
    driver.get(f"{coordinator.url}/ui")
    assert driver.current_url == f"{coordinator.url}/ui/"
    wait_for(lambda: shown(driver, "#login"), timeout=10, what="the sign-in form")
    assert not shown(driver, "#jobs")

    sign_in(driver, "not-the-token-0123456789")
    wait_for(lambda: "refused" in text_of(driver, "#login-error"), timeout=10,
             what="the wrong token refused")
    assert not shown(driver, "#jobs") and not shown(driver, "#view")
    assert driver.execute_script("return sessionStorage.length") == 0

    sign_in(driver, TOKEN)
    wait_for(lambda: shown(driver, "#jobs"), timeout=10, what="the jobs table")
    assert "No jobs yet" in text_of(driver, "#jobs")
    assert_nothing_secret(driver)

    # A node with two GPUs, one failed; the job asks for a label it lacks (stays PENDING).
    inventory = tmp_path / "gpus.json"
    inventory.write_text(json.dumps({"gpus": [
        {"index": 0, "uuid": "GPU-ui-0", "model": "NVIDIA H100 80GB HBM3",
         "memory_bytes": 80 << 30},
        {"index": 1, "uuid": "GPU-ui-1", "model": "NVIDIA H100 80GB HBM3",
         "memory_bytes": 80 << 30, "healthy": False, "fault": "XID 79: fell off the bus"},
    ]}))
    agents.start_agent("g", env=dict(os.environ, TIDAL_GPU_INVENTORY_FILE=str(inventory)))
    job_id = api.post("/v1/jobs", json=job_spec(
        "appears", env={"UI_TEST_SECRET": SECRET}, min_nodes=1, max_nodes=2,
        node_selector={"pool": "elsewhere"})).json()["job_id"]
    job_ids.append(job_id)
    row = wait_for(lambda: job_row(driver, job_id), timeout=15, what="the new job's row")
    assert row["Name"] == "appears" and row["Phase"] == "PENDING" and row["World size"] == "0"
    assert row["Queue"] == job_view(api, job_id)["spec"].get("queue", "—")
    assert_nothing_secret(driver)

    # A job's page: what it is, its environment by name only, the Grafana link.

    click(driver, f"#jobs a[href='#/jobs/{job_id}']")
    wait_for(lambda: summary(driver).get("Phase") == "PENDING", timeout=10, what="the job page")
    assert summary(driver)["Environment"] == "UI_TEST_SECRET (values hidden)"
    href = driver.execute_script("return document.querySelector('#grafana-link').href")
    assert href == f"{GRAFANA}/d/tidal-overview/tidal?var-job_id={job_id}"
    wait_for(lambda: [e["reason"] for e in events_shown(driver)] == ["submitted"], timeout=10,
             what="the submitted event")
    assert_nothing_secret(driver)

    # The page's pure parts: a recovery lasts from its event to the job running again.
    durations = driver.execute_script(
        """
        const ev = (seq, t, phase, reason, nodes = []) =>
          ({seq, time: t, phase, reason, nodes, world_size: 2});
        const out = window.tidalUi.recoveries([
          ev(0, '2026-01-01T00:00:00Z', 'PENDING', 'submitted'),
          ev(1, '2026-01-01T00:00:01Z', 'RUNNING', 'scheduled'),
          ev(2, '2026-01-01T00:00:10Z', 'RESCALING', 'node_lost'),
          ev(3, '2026-01-01T00:00:13.5Z', 'RUNNING', 'restarted'),
          // New bounds alone (the API's event, the scheduler's): nothing restarts.
          ev(4, '2026-01-01T00:00:20Z', 'RUNNING', 'scaled_by_user'),
          ev(5, '2026-01-01T00:00:20Z', 'RUNNING', 'scaled_by_user'),
          ev(6, '2026-01-01T00:00:30Z', 'RUNNING', 'node_joined', ['c']),
          ev(7, '2026-01-01T00:00:30Z', 'RESCALING', 'resizing'),
          ev(8, '2026-01-01T00:00:31Z', 'RUNNING', 'resized_live'),
          ev(9, '2026-01-01T00:01:00Z', 'RUNNING', 'scaled_by_user', ['c']),
          ev(10, '2026-01-01T00:01:00Z', 'RUNNING', 'node_lost'),
        ], Date.parse('2026-01-01T00:01:02Z'));
        return Array.from(out.entries());
        """
    )
    assert durations == [[2, {"seconds": 3.5, "ongoing": False}],
                         [6, {"seconds": 1, "ongoing": False}],
                         [9, {"seconds": 2, "ongoing": True}]]
    # Nodes that join in the pass that starts the job are its start, not a recovery.
    durations = driver.execute_script(
        """
        const ev = (seq, t, phase, reason, nodes = []) =>
          ({seq, time: t, phase, reason, nodes, world_size: 2});
        const out = window.tidalUi.recoveries([
          ev(0, '2026-01-01T00:00:00Z', 'PENDING', 'submitted'),
          ev(1, '2026-01-01T00:00:01Z', 'PENDING', 'scheduled'),
          ev(2, '2026-01-01T00:00:01Z', 'PENDING', 'node_joined'),
          ev(3, '2026-01-01T00:00:01Z', 'RUNNING', 'scheduled'),
          ev(4, '2026-01-01T00:00:40Z', 'RUNNING', 'scaled_by_user'),
          ev(5, '2026-01-01T00:00:40Z', 'RUNNING', 'scaled_by_user', ['b']),
          ev(6, '2026-01-01T00:00:40Z', 'RESCALING', 'resizing'),
          ev(7, '2026-01-01T00:00:51Z', 'RUNNING', 'restarted'),
        ], Date.parse('2026-01-01T00:01:00Z'));
        return Array.from(out.entries());
        """
    )
    assert durations == [[5, {"seconds": 11, "ongoing": False}]]
    goodput = driver.execute_script(
        "return [window.tidalUi.goodputText({goodput: 0.9712, lost_seconds: {restart: 9,"
        " detection: 1, redone: 2, checkpoint_stall: 0.01}}), window.tidalUi.goodputText({})];")
    assert goodput == ["97.1% (lost 12.0 s: detection 1.0, redone 2.0, restart 9.0)", "—"]

    click(driver, "#nav a[href='#/nodes']")
    wait_for(lambda: shown(driver, "#nodes tr[data-node='g']"), timeout=30, what="node g's row")
    gpus = text_of(driver, "#nodes tr[data-node='g'] ul.gpus")
    assert "GPU 0 NVIDIA H100 80GB HBM3 80 GiB" in gpus
    assert "GPU 1 NVIDIA H100 80GB HBM3 80 GiB — failed: XID 79: fell off the bus" in gpus

    click(driver, "#sign-out")
    wait_for(lambda: shown(driver, "#login"), timeout=10, what="the sign-in form again")
    assert driver.execute_script("return sessionStorage.length") == 0
    assert not shown(driver, "#view")
    assert_nothing_secret(driver)
    assert_no_script_errors(driver)


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_a_resize_shows_on_the_job_page_with_its_recovery_and_logs(
    browser: Any, cluster: tuple[CoordinatorProcess, AgentCluster]
):
    api = cluster[0].client()
    job_ids: list[str] = []
    with explained(browser, cluster, api, job_ids):
        _resize_scenario(*cluster, api, browser, job_ids)


def _resize_scenario(coordinator: CoordinatorProcess, agents: AgentCluster, api: httpx.Client,
                     driver: Any, job_ids: list[str]) -> None:

    agents.start_agent("a")
    agents.start_agent("b")
    spec = job_spec("resized", command=[sys.executable, str(STEPPER)],
                    env={"UI_TEST_SECRET": SECRET}, min_nodes=1, max_nodes=2, grace_period_s=5)
    job_id = api.post("/v1/jobs", json=spec).json()["job_id"]
    job_ids.append(job_id)

    driver.get(f"{coordinator.url}/ui/")
    sign_in(driver, TOKEN)

    def running_at(size: int) -> dict[str, str] | None:
        row = job_row(driver, job_id)
        ok = row and row["Phase"] == "RUNNING" and row["World size"] == str(size)
        return row if ok and row["Step"] != "—" and row["Throughput"] != "—" else None

    # Generous: two agents start cold (each imports torch), on a loaded machine 80 s.
    wait_for(lambda: running_at(2), timeout=180, what="the row at world size 2, stepping")
    assert_nothing_secret(driver)
    screenshot(driver, "ui-jobs.png")

    click(driver, f"#jobs a[href='#/jobs/{job_id}']")
    wait_for(lambda: summary(driver).get("World size", "").startswith("2 "), timeout=30,
             what="the job page at world size 2")
    with_logs = logs_route_exists(coordinator.url)
    if with_logs:
        wait_for(lambda: "step " in text_of(driver, "#logs"), timeout=60, what="the job's logs")
    else:  # said politely until the coordinator serves logs
        wait_for(lambda: "not available" in text_of(driver, "#logs-status"), timeout=10,
                 what="the logs' absence explained")
    chart_before = chart_steps(driver)
    assert chart_before[-1] == 2

    response = api.patch(f"/v1/jobs/{job_id}", json={"max_nodes": 1})
    assert response.status_code == 200, response.text

    def resized() -> list[dict[str, str]] | None:
        # The API's event (the new bounds: nothing restarts for them), then the
        # scheduler's (a node released, world size 1), newest first: the
        # recovery starts at the release.
        scaled = [e for e in events_shown(driver) if e["reason"] == "scaled_by_user"]
        shown_now = summary(driver)
        ok = (shown_now.get("World size", "").startswith("1 ")
              and shown_now.get("Phase") == "RUNNING"
              and len(scaled) == 2 and scaled[0]["world"] == "1"
              and scaled[0]["recovery"].endswith(" s") and "so far" not in scaled[0]["recovery"]
              and not scaled[1]["recovery"].endswith(" s"))
        return scaled if ok else None

    wait_for(resized, timeout=180, what="the page at world size 1 with the resize's recovery")
    assert chart_steps(driver) == [*chart_before, 1]
    wait_for(lambda: summary(driver).get("Step", "—") != "—", timeout=60, what="steps again")
    wait_for(lambda: summary(driver).get("Throughput", "—") != "—", timeout=60,
             what="the throughput measured again")
    if with_logs:
        wait_for(lambda: "of 1" in text_of(driver, "#logs"), timeout=60,
                 what="logs from world size 1")
    assert_nothing_secret(driver)
    screenshot(driver, "ui-job.png")

    click(driver, "#nav a[href='#/nodes']")
    wait_for(lambda: shown(driver, "#nodes tr[data-node='a']")
             and shown(driver, "#nodes tr[data-node='b']"), timeout=10, what="both nodes")
    holders = [n for n in ("a", "b") if job_id in text_of(driver, f"#nodes tr[data-node='{n}']")]
    assert len(holders) == 1
    assert_nothing_secret(driver)

    # A job that fails: its page says why.
    failing = api.post("/v1/jobs", json=job_spec(
        "fails", command=[sys.executable, "-c", "import sys; sys.exit(3)"], max_restarts=0,
    )).json()["job_id"]
    job_ids.append(failing)
    driver.get(f"{coordinator.url}/ui/#/jobs/{failing}")
    wait_for(lambda: "exit code 3" in text_of(driver, "#job-error"), timeout=60,
             what="the failed job's error on its page")
    assert summary(driver)["Phase"] == "FAILED"
    assert_nothing_secret(driver)
    assert_no_script_errors(driver)
    api.post(f"/v1/jobs/{job_id}/cancel")
