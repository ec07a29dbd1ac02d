"""Headless Chromium through selenium for the web page's tests: `chromium()` gives a driver
(the importing test module is skipped without chromium, chromium-driver or selenium), plus
the few lookups the tests share. Screenshots go to ARTIFACTS ($PAGODA_TEST_ARTIFACTS,
default /tmp/pagoda-test-artifacts).

Canvas text is not in the DOM: CANVAS_TEXT (an init script) wraps the 2D context's
fillText to keep what each canvas last drew, reset at each redraw's clearRect, and
`drawn_text(driver, canvas_id)` reads it."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
ARTIFACTS = Path(os.environ.get("PAGODA_TEST_ARTIFACTS", "/tmp/pagoda-test-artifacts"))
DESKTOP_SIZE = (1400, 1250)

if not (shutil.which(CHROMIUM) and shutil.which(CHROMEDRIVER)):
    pytest.skip("needs chromium and chromium-driver (Debian packages; .ci/run installs them)",
                allow_module_level=True)
webdriver = pytest.importorskip("selenium.webdriver", reason="selenium: pip install -e .[test]")
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys  # noqa: F401  (for the tests)
from selenium.webdriver.support.ui import WebDriverWait

CANVAS_TEXT = """
window.__drawn = {};
(() => {
  const proto = CanvasRenderingContext2D.prototype;
  const clearRect = proto.clearRect, fillText = proto.fillText;
  proto.clearRect = function (...args) {
    window.__drawn[this.canvas.id] = [];
    return clearRect.apply(this, args);
  };
  proto.fillText = function (text, ...args) {
    (window.__drawn[this.canvas.id] ??= []).push(String(text));
    return fillText.call(this, text, ...args);
  };
})();
"""


@contextmanager
def chromium(init_script: str | None = None) -> Iterator:
    """A headless browser at desktop size, its console log kept; `init_script` runs in
    every page before the page's own scripts (to stub fetch, say)."""
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in ["--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                     "--window-size={},{}".format(*DESKTOP_SIZE)]:
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=webdriver.ChromeService(CHROMEDRIVER), options=options)
    try:
        driver.set_script_timeout(30)
        if init_script is not None:
            driver.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument",
                                   {"source": init_script})
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        yield driver
    finally:
        driver.quit()


def by_id(driver, element_id: str):
    return driver.find_element(By.ID, element_id)


def wait(driver, condition, timeout: float = 60.0, message: str = ""):
    return WebDriverWait(driver, timeout, poll_frequency=0.2).until(
        lambda d: condition(d), message)


def console_errors(driver) -> list[dict]:
    return [entry for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]


def drawn_text(driver, canvas_id: str) -> list[str]:
    """The texts the canvas drew in its last redraw (needs CANVAS_TEXT)."""
    return driver.execute_script("return window.__drawn[arguments[0]] || []", canvas_id)
