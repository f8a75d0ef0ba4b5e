"""Drives the dashboard in headless Chromium (Selenium + Debian's chromedriver) and prints what it saw.

Run by tests/gateway/test_dashboard_browser.py with the Python of a separate venv that has selenium:
``drive_dashboard.py BASE_URL ADMIN_TOKEN SCREENSHOT_PNG``. The last stdout line is one JSON object of
facts; the test asserts on them. It checks nothing itself, so a failure reads as a fact that differs.
"""

from __future__ import annotations

import base64
import json
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from selenium import webdriver
from selenium.common.exceptions import TimeoutException, WebDriverException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
WIDTH = 1440
FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-dev-shm-usage", f"--window-size={WIDTH},1000", "--hide-scrollbars", "--force-device-scale-factor=1",
)


def _driver(profile_dir: str) -> webdriver.Chrome:
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (*FLAGS, f"--user-data-dir={profile_dir}"):
        options.add_argument(flag)
    return webdriver.Chrome(options=options, service=Service(executable_path=CHROMEDRIVER))


def _wait(driver: webdriver.Chrome, what: Callable[[webdriver.Chrome], Any], timeout_s: float) -> bool:
    # While a page is being replaced, Chrome answers some commands with a generic "unknown error"
    # (e.g. "Node with given id does not belong to the document") rather than a stale-element one;
    # either means "not yet", so poll again.
    try:
        WebDriverWait(driver, timeout_s, poll_frequency=0.2, ignored_exceptions=(WebDriverException,)).until(what)
        return True
    except TimeoutException:
        return False


def _count(driver: webdriver.Chrome, css: str) -> int:
    return int(driver.execute_script("return document.querySelectorAll(arguments[0]).length", css))


def _sign_in_with_form(driver: webdriver.Chrome, base: str, token: str) -> str:
    driver.get(base + "/dashboard")
    driver.execute_script("document.documentElement.dataset.formPage = '1'")
    field = driver.find_element(By.ID, "token")
    field.clear()
    field.send_keys(token)
    driver.find_element(By.ID, "sign-in").click()
    # the form's page has been replaced by the answer once the mark set on it is gone
    _wait(driver, lambda d: d.execute_script("return document.readyState === 'complete' && !document.documentElement.dataset.formPage"), 10)
    # read in one script call, so a late re-render cannot leave us holding a stale element
    return str(driver.execute_script("var e = document.getElementById('login-error'); return e ? e.textContent.trim() : '';"))


def _full_page_png(driver: webdriver.Chrome, path: str) -> None:
    height = int(driver.execute_script("return Math.ceil(document.documentElement.scrollHeight)"))
    shot = driver.execute_cdp_cmd("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True, "clip": {"x": 0, "y": 0, "width": WIDTH, "height": height, "scale": 1}})
    with open(path, "wb") as out:
        out.write(base64.b64decode(shot["data"]))


def main(base: str, token: str, screenshot: str) -> dict[str, Any]:
    facts: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="polymorph-chromium-") as profile:
        driver = _driver(profile)
        try:
            # A wrong token, in the URL or the form, gets the login page again and no session.
            driver.get(base + "/dashboard?token=not-the-admin-token")
            facts["wrong_query_token_page"] = driver.find_element(By.ID, "login-error").text
            facts["wrong_query_token_has_pools"] = _count(driver, "#pools") > 0
            facts["wrong_form_token_page"] = _sign_in_with_form(driver, base, "still-not-the-admin-token")
            facts["cookies_after_wrong_tokens"] = [c["name"] for c in driver.get_cookies()]
            # The right token through the form.
            facts["right_form_token_error"] = _sign_in_with_form(driver, base, token)
            facts["url_after_form_login"] = driver.current_url
            facts["cookie_visible_to_scripts"] = driver.execute_script("return document.cookie")
            # The deployment is live: the first complete 10 s bucket of traffic, the controller's first
            # decision (after its warm-up and a re-plan), then the drift reaching the mix take their time.
            started = time.monotonic()
            facts["pools_shown"] = _wait(driver, lambda d: _count(d, "#pools .pool") >= 1, 30)
            facts["mix_shown"] = _wait(driver, lambda d: _count(d, "#mix-chart path.area") >= 1, 60)
            # (the first re-plan is a minute of CPU alone, several beside a fresh machine's installs)
            facts["decisions_shown"] = _wait(driver, lambda d: _count(d, "#decisions .decision") >= 1, 180)
            facts["mix_shows_drift"] = _wait(driver, lambda d: _count(d, "#mix-chart path.area") >= 2, 60)
            facts["seconds_to_render"] = round(time.monotonic() - started, 2)
            facts["pool_names"] = driver.execute_script("return [...document.querySelectorAll('#pools .pool')].map(p => p.dataset.pool)")
            facts["mix_shapes"] = driver.execute_script("return [...document.querySelectorAll('#mix-chart path.area')].map(p => p.dataset.shape)")
            # a decision is marked once the mix chart's buckets reach its time (complete 10 s buckets only):
            # one that came late, in the bucket still filling, shows at the next refresh
            _wait(driver, lambda d: _count(d, "#mix-chart .event") >= 1, 30)
            facts["decision_markers"] = _count(driver, "#mix-chart .event")
            facts["decision_kinds"] = driver.execute_script("return [...document.querySelectorAll('#decisions .decision')].map(d => d.dataset.kind)")
            facts["tier_lines"] = _count(driver, "#ttft-chart path.line")
            # Open the drift entry: its evidence (the mix before and after) must show.
            drift = driver.find_elements(By.CSS_SELECTOR, "#decisions .decision[data-kind='drift'] > summary")
            if drift:
                driver.execute_script("arguments[0].scrollIntoView({block: 'center'})", drift[0])
                drift[0].click()
            facts["evidence_text"] = driver.execute_script("const d = document.querySelector('#decisions .decision[open] .evidence'); return d ? d.innerText : ''")
            facts["live_status"] = driver.find_element(By.ID, "updated").text
            driver.execute_script("window.scrollTo(0, 0)")
            _full_page_png(driver, screenshot)
            # A fresh browser with the right token in the URL: signed in, and the token gone from the address.
            driver.delete_all_cookies()
            driver.get(base + f"/dashboard?token={token}")
            facts["url_after_query_login"] = driver.current_url
            facts["pools_after_query_login"] = _wait(driver, lambda d: _count(d, "#pools .pool") >= 1, 30)
            facts["console_errors"] = [e["message"] for e in driver.get_log("browser") if e.get("level") == "SEVERE"]
        finally:
            driver.quit()
    return facts


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2], sys.argv[3])))
