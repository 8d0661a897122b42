"""Debian's headless chromium for the tests that look at a page in a real browser (``make setup`` installs it).

Two ways in: ``chromium_driver`` (Selenium through Debian's chromedriver, for pages
that are driven: the playground) and ``run_chromium`` (the browser's own
``--dump-dom`` / ``--screenshot`` command line, for a static page such as the run
report). Selenium is handed both paths, so Selenium Manager never looks for or
downloads a browser.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
# No network, no updates, no GPU: the same page renders the same way on every machine.
QUIET_FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
               "--disable-background-networking", "--disable-component-update", "--disable-sync",
               "--disable-dev-shm-usage")


def require_chromium(driver: bool = False) -> None:
    needed = [CHROMIUM, CHROMEDRIVER] if driver else [CHROMIUM]
    if not all(path.exists() for path in needed):
        pytest.fail(f"{' and '.join(map(str, needed))} needed: apt-get install chromium chromium-driver (make setup)")


@contextmanager
def chromium_driver(profile_dir: Path, width: int = 1280, height: int = 800) -> Iterator:
    """A Selenium Chrome driver on Debian's chromium, its viewport exactly ``width`` x ``height`` CSS pixels."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service as ChromeService

    require_chromium(driver=True)
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in (*QUIET_FLAGS, f"--window-size={width},{height}", f"--user-data-dir={profile_dir}"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=ChromeService(executable_path=str(CHROMEDRIVER)), options=options)
    try:
        # exactly width x height CSS pixels, whatever the window decorations of this chromium build
        driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                               {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False})
        yield driver
    finally:
        driver.quit()


def run_chromium(profile_dir: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """``chromium --headless ... ARGS`` (e.g. ``--dump-dom URL``); raises with its stderr when it fails."""
    require_chromium()
    result = subprocess.run([str(CHROMIUM), *QUIET_FLAGS, f"--user-data-dir={profile_dir}", *args],
                            capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        raise AssertionError(f"chromium {' '.join(args)} exited {result.returncode}: {result.stderr[-2000:]}")
    return result
