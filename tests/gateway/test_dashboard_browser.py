"""The dashboard in a real browser against a real deployment while a drift plays.

`polymorph serve` runs a copy of config.example.yaml (two pools of emulated replicas, the controller
on) with the fleet 20x faster than real time; `polymorph demo` replays a short drift through it (chat,
then long prompts) while headless Chromium (Debian's package) driven by Selenium signs in (a wrong
token is refused first), waits for the pools, the traffic-mix chart, the controller's first decision
and the drift reaching the mix, opens the drift's evidence, and saves a full-page screenshot (set
POLYMORPH_DASHBOARD_SCREENSHOT=path to keep a copy, e.g. docs/dashboard.png).

Chromium, its driver and Selenium are test-only: Chromium comes from apt when missing (where it cannot
be installed, without root or apt-get, the test skips and says why); Selenium goes into its own venv
under the project's cache on first use (the ``selenium_python`` fixture), never the project's.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from loadtest.plots import PLOT_FILES
from tests.conftest import REPO
from tests.support.procs import POLYMORPH, start_gateway

CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
DRIVER_SCRIPT = Path(__file__).parent / "browser" / "drive_dashboard.py"
TOKEN = "dashboard-browser-test-token"
SPEED = 20.0  # emulated GPUs and the controller's clock: 30 s of wall time are 10 minutes of fleet time
# The replayed drift, in fleet time: chat for 300 s, then long prompts; 1 request/s is 20/s on the wall clock.
DRIFT_AT_S, DURATION_S, RATE_RPS = 300, 600, 1.0
EXPECTED_401 = "the server responded with a status of 401"


def _run(argv: list[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    return subprocess.run(argv, check=False, capture_output=True, text=True, timeout=timeout_s, env=env, stdin=subprocess.DEVNULL)


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


def _deployment_config(tmp: Path) -> Path:
    """config.example.yaml with the test's admin token, a faster fleet and its own decision log."""
    config = yaml.safe_load((REPO / "config.example.yaml").read_text())
    config["server"].update(admin_token=TOKEN, access_log=False)
    config["tenants_dir"] = str(REPO / "tenants")
    config["fleet"]["emulator_speed"] = SPEED
    config["fleet"]["controller"]["decision_log"] = str(tmp / "decisions.jsonl")
    path = tmp / "config.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    return path


def _drift_scenario(tmp: Path) -> Path:
    """The demo's scenario, shortened for a test."""
    scenario = yaml.safe_load((REPO / "examples" / "drift-demo.yaml").read_text())
    scenario["duration_s"] = DURATION_S
    stream = scenario["streams"][0]
    stream["arrival"]["rate_rps"] = RATE_RPS
    stream["phases"][1]["at_s"] = DRIFT_AT_S
    path = tmp / "drift.yaml"
    path.write_text(json.dumps(scenario))
    return path


def _png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    width, height = struct.unpack(">II", head[16:24])
    return width, height


def test_dashboard_shows_a_live_drift_and_refuses_a_wrong_token(selenium_python: Path, tmp_path: Path) -> None:
    _ensure_chromium()
    gateway = start_gateway(tmp_path, ["--config", str(_deployment_config(tmp_path))])
    screenshot = tmp_path / "dashboard.png"
    demo_out = tmp_path / "demo"
    demo: subprocess.Popen[str] | None = None
    try:
        started = time.monotonic()
        demo = subprocess.Popen(
            [*POLYMORPH, "demo", "--url", gateway.url, "--admin-token", TOKEN, "--scenario", str(_drift_scenario(tmp_path)),
             "--no-progress", "--out", str(demo_out)],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL,
        )
        done = subprocess.run(
            [str(selenium_python), str(DRIVER_SCRIPT), gateway.url, TOKEN, str(screenshot)],
            check=False, capture_output=True, text=True, timeout=480, stdin=subprocess.DEVNULL, env={**os.environ, "SE_OFFLINE": "true"},
        )
        browser_s = time.monotonic() - started
        demo_stdout, demo_stderr = demo.communicate(timeout=120)
    finally:
        if demo is not None and demo.poll() is None:
            demo.kill()
            demo.wait(10)
        gateway.stop()
    assert done.returncode == 0, f"{done.stderr[-3000:]}\ngateway log:\n{gateway.log()[-2000:]}"
    facts = json.loads(done.stdout.strip().splitlines()[-1])

    # A wrong token, in the URL or the form, is refused: the login page again, no cookie.
    assert facts["wrong_query_token_page"] == "That is not the admin token."
    assert not facts["wrong_query_token_has_pools"]
    assert facts["wrong_form_token_page"] == "That is not the admin token."
    assert facts["cookies_after_wrong_tokens"] == []
    # The right one signs in; the session cookie is invisible to scripts; the token leaves the URL.
    assert facts["right_form_token_error"] == ""
    assert facts["url_after_form_login"] == gateway.url + "/dashboard"
    assert facts["cookie_visible_to_scripts"] == ""
    assert facts["url_after_query_login"] == gateway.url + "/dashboard"
    assert facts["pools_after_query_login"]
    # The live fleet: the config's pools, or the controller's <shape>@<gpu> pools once it has moved replicas.
    assert facts["pools_shown"] and facts["pool_names"], facts
    assert all(name in ("chat-h100", "long-h200") or "@" in name for name in facts["pool_names"]), facts["pool_names"]
    # The mix chart shows the chat traffic, then the drift to long prompts, with the decisions marked on it.
    assert facts["mix_shown"] and "short-chat" in facts["mix_shapes"], facts["mix_shapes"]
    assert facts["mix_shows_drift"] and "long-context" in facts["mix_shapes"], facts["mix_shapes"]
    assert facts["decision_markers"] >= 1, (facts["decision_kinds"], facts["seconds_to_render"])
    # The controller's first decision is a drift (from no traffic to the chat mix); its evidence shows the mix.
    assert facts["decisions_shown"] and facts["decision_kinds"][-1] == "drift", facts["decision_kinds"]
    assert "short-chat" in facts["evidence_text"], facts["evidence_text"]
    assert facts["tier_lines"] >= 1
    assert facts["live_status"].startswith("updated ")
    # No script error and no CSP violation; the only console errors are the refused sign-ins.
    assert [e for e in facts["console_errors"] if EXPECTED_401 not in e] == []

    # The demo that played the drift finished, wrote its plots and summed up the controller's decisions.
    assert demo.returncode == 0, f"{demo_stderr[-3000:]}\n{demo_stdout[-2000:]}"
    assert f"dashboard: {gateway.url}/dashboard" in demo_stdout
    # (its own summary may miss the first decision: a re-plan's minute of CPU can log it after the replay ends)
    assert "the controller took" in demo_stdout or "took no decision" in demo_stdout, demo_stdout
    assert all((demo_out / name).is_file() for name in ("results.json", *PLOT_FILES))

    width, height = _png_size(screenshot)
    assert width == 1440 and height > 1000, (width, height)
    keep = os.environ.get("POLYMORPH_DASHBOARD_SCREENSHOT")
    if keep:
        shutil.copyfile(screenshot, keep)
    print(f"gateway up to browser done {browser_s:.1f} s (rendered in {facts['seconds_to_render']} s); screenshot {width}x{height} at {keep or screenshot}")
