"""A real headless chromium for the web page's tests, driven by Selenium.

Debian's ``chromium`` and ``chromium-driver`` (``.ci/system-deps.sh`` installs
them); Selenium is told both paths and runs offline, so selenium-manager never
downloads a browser or a driver. chromedriver runs in its own session, and
its whole process group (the browser included) is killed at teardown, even
when the test failed or ``quit`` did not answer.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

CHROMIUM = Path(os.environ.get("TIDAL_CHROMIUM", "/usr/bin/chromium"))
CHROMEDRIVER = Path(os.environ.get("TIDAL_CHROMEDRIVER", "/usr/bin/chromedriver"))


def _missing() -> str | None:
    absent = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not os.access(p, os.X_OK)]
    if absent:
        return (f"no headless browser: {', '.join(absent)} missing (apt-get install chromium "
                "chromium-driver; .ci/system-deps.sh installs them in CI)")
    return None


@pytest.fixture
def browser(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    """A Selenium ``webdriver.Chrome`` on a fresh profile, 1280x900."""
    reason = _missing()
    if reason is not None:
        pytest.skip(reason)
    monkeypatch.setenv("SE_OFFLINE", "true")  # selenium-manager must not fetch anything
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})  # console errors, for checks
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1280,900", "--no-first-run", "--disable-extensions",
                "--disable-background-networking", f"--user-data-dir={tmp_path / 'chromium'}"):
        options.add_argument(arg)
    service = Service(executable_path=str(CHROMEDRIVER),
                      log_output=str(tmp_path / "chromedriver.log"),
                      popen_kw={"start_new_session": True})
    try:
        driver = webdriver.Chrome(service=service, options=options)
    except BaseException:
        if service.process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(service.process.pid, signal.SIGKILL)
        raise
    pgid = service.process.pid  # a session leader: its group is chromedriver and the browser
    try:
        yield driver
    finally:
        try:
            driver.quit()
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
