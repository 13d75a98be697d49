"""A person's view of the MLflow UI: headless Chromium (Debian's chromium and chromium-driver) on a live
`mlflow server`, at 1600x1000; screenshots go to $DRAFTEROPS_SCREENSHOTS when set, else
test-artifacts/screenshots/ in the checkout."""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from pathlib import Path

from tests.helpers.servers import mlflow_server

ROOT = Path(__file__).resolve().parents[2]

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")


@contextlib.contextmanager
def browser_on(folder: Path, backend_uri: str):
    """(browser, base URL): headless Chromium on a live `mlflow server` for the store."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1600,1000"):
        opts.add_argument(arg)
    with mlflow_server(folder, backend_uri) as base:
        browser = webdriver.Chrome(service=Service(DRIVER), options=opts)
        width, height = VIEWPORT  # the page itself is 1600x1000, whatever the browser's own frame takes
        browser.execute_cdp_cmd(
            "Emulation.setDeviceMetricsOverride",
            {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False},
        )
        try:
            yield browser, base
        finally:
            browser.quit()


VIEWPORT = (1600, 1000)


def shots() -> Path:
    folder = Path(os.environ.get("DRAFTEROPS_SCREENSHOTS", ROOT / "test-artifacts" / "screenshots"))
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def page_text(browser, url: str, *expected: str, timeout: float = 60) -> str:
    """The page's visible text once every expected string shows (the UI renders after load)."""
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(url)
    text = ""

    def ready(b):
        nonlocal text
        text = b.execute_script("return document.body.innerText")
        return all(e in text for e in expected)

    try:
        WebDriverWait(browser, timeout).until(ready)
    except Exception:
        raise AssertionError(f"{url}: missing {[e for e in expected if e not in text]}; page:\n{text[:3000]}") from None
    return text


def close_assistant(browser) -> None:
    """MLflow 3.17 opens its Assistant panel by itself on a first visit, squeezing a run page into one
    column; a newcomer closes it once (the browser remembers), and so does this test."""
    from selenium.webdriver.common.by import By

    for button in browser.find_elements(By.CSS_SELECTOR, "button[aria-label='Close']"):
        if button.is_displayed():
            button.click()
            time.sleep(1)
            return


def above_the_fold(browser, needle: str) -> None:
    """`needle` is on screen without scrolling: the text node holding it lies inside the viewport."""
    where = browser.execute_script(
        """const w = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
        while (w.nextNode()) {
          if (w.currentNode.textContent.includes(arguments[0])) {
            const r = w.currentNode.parentElement.getBoundingClientRect();
            return [r.top, r.bottom, window.innerHeight];
          }
        }
        return null;""",
        needle,
    )
    assert where is not None, f"{needle!r} is not on the page"
    top, bottom, height = where
    assert top >= 0 and bottom <= height, f"{needle!r} is at {top:.0f}-{bottom:.0f} px, below the fold ({height} px)"
