"""The dashboard in a real browser: headless Chromium (Debian's package) driven by Selenium.

It signs in (a wrong token is refused first), waits for the pools, the traffic-mix chart and the
decision log to render while traffic plays, opens a decision's evidence, and saves a full-page
screenshot (set POLYMORPH_DASHBOARD_SCREENSHOT=path to keep a copy, e.g. docs/dashboard.png).

The deployment is tests/gateway/dashboard_fixture.py: the real dashboard routes and Series with a
scripted drift behind /admin/state and /admin/decisions, until the gateway serves its decision log.
Chromium, its driver and Selenium are test-only: Chromium comes from apt when missing, Selenium goes
into its own venv under ~/.cache/polymorph, never the project's. Where they cannot be installed the
test skips and says why.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, free_port
from tests.support.procs import Proc, wait_http

CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
BROWSER_VENV = Path.home() / ".cache" / "polymorph" / "browser-venv"
SELENIUM = "selenium==4.50.0"
DRIVER_SCRIPT = Path(__file__).parent / "browser" / "drive_dashboard.py"
TOKEN = "dashboard-browser-test-token"
EXPECTED_401 = "the server responded with a status of 401"


def _run(argv: list[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, env=env, stdin=subprocess.DEVNULL)


def _ensure_chromium() -> None:
    if CHROMIUM.exists() and CHROMEDRIVER.exists():
        return
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        pytest.skip("Chromium is missing and cannot be installed here (needs root and apt-get): apt-get install chromium chromium-driver")
    install = ["apt-get", "install", "-y", "-q", "chromium", "chromium-driver"]
    done = _run(install, 900)
    if done.returncode != 0:  # a fresh machine may have no package lists yet
        _run(["apt-get", "update", "-q"], 300)
        done = _run(install, 900)
    if done.returncode != 0 or not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
        pytest.skip(f"Chromium could not be installed with apt-get: {done.stderr.strip()[-500:]}")


def _selenium_python() -> Path:
    python = BROWSER_VENV / "bin" / "python"
    if python.exists() and _run([str(python), "-c", "import selenium"], 60).returncode == 0:
        return python
    made = _run([sys.executable, "-m", "venv", "--clear", str(BROWSER_VENV)], 120)
    if made.returncode == 0:
        made = _run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", SELENIUM], 600)
    if made.returncode != 0:
        pytest.skip(f"Selenium could not be installed into {BROWSER_VENV}: {made.stderr.strip()[-500:]}")
    return python


def _start_fixture(tmp: Path) -> Proc:
    port = free_port()
    log_path = tmp / "dashboard-fixture.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-W", "error", "-m", "tests.gateway.dashboard_fixture", "--port", str(port), "--token", TOKEN],
            cwd=REPO, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )
    proc = Proc(process, f"http://127.0.0.1:{port}", log_path)
    try:
        wait_http(proc.url + "/healthz", process=process)
    except Exception:
        proc.stop()
        raise RuntimeError(f"the dashboard fixture failed to start:\n{proc.log()}") from None
    return proc


def _png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    width, height = struct.unpack(">II", head[16:24])
    return width, height


def test_dashboard_renders_pools_mix_and_decisions_and_refuses_a_wrong_token(tmp_path: Path) -> None:
    _ensure_chromium()
    python = _selenium_python()
    fixture = _start_fixture(tmp_path)
    screenshot = tmp_path / "dashboard.png"
    try:
        started = time.monotonic()
        done = subprocess.run(
            [str(python), str(DRIVER_SCRIPT), fixture.url, TOKEN, str(screenshot)],
            capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL, env={**os.environ, "SE_OFFLINE": "true"},
        )
        browser_s = time.monotonic() - started
    finally:
        fixture.stop()
    assert done.returncode == 0, f"{done.stderr[-3000:]}\nfixture log:\n{fixture.log()[-2000:]}"
    facts = json.loads(done.stdout.strip().splitlines()[-1])

    # A wrong token, in the URL or the form, is refused: the login page again, no cookie.
    assert facts["wrong_query_token_page"] == "That is not the admin token."
    assert not facts["wrong_query_token_has_pools"]
    assert facts["wrong_form_token_page"] == "That is not the admin token."
    assert facts["cookies_after_wrong_tokens"] == []
    # The right one signs in; the session cookie is invisible to scripts; the token leaves the URL.
    assert facts["right_form_token_error"] == ""
    assert facts["url_after_form_login"] == fixture.url + "/dashboard"
    assert facts["cookie_visible_to_scripts"] == ""
    assert facts["url_after_query_login"] == fixture.url + "/dashboard"
    assert facts["pools_after_query_login"]
    # Pools, the mix chart with decision markers, per-tier lines and the decision log render live.
    assert facts["pools_shown"] and facts["pool_names"] == ["chat-h100", "long-h200"]
    assert facts["mix_shown"] and facts["mix_shapes"] == ["short-chat", "long-context", "reasoning", "batch"]
    assert facts["decision_markers"] == 6
    assert facts["decisions_shown"] and facts["decision_kinds"][-1] == "drift" and len(facts["decision_kinds"]) == 6
    assert facts["tier_lines"] == 3
    assert "long-context" in facts["evidence_text"] and "+0.351" in facts["evidence_text"]
    assert facts["live_status"].startswith("updated ")
    # No script error and no CSP violation; the only console errors are the refused sign-ins.
    assert [e for e in facts["console_errors"] if EXPECTED_401 not in e] == []

    width, height = _png_size(screenshot)
    assert width == 1440 and height > 1200, (width, height)
    keep = os.environ.get("POLYMORPH_DASHBOARD_SCREENSHOT")
    if keep:
        shutil.copyfile(screenshot, keep)
    print(f"browser part took {browser_s:.1f} s; screenshot {width}x{height} at {keep or screenshot}")
