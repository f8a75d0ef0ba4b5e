"""Client tools the tests drive, installed on first use like the engines (progress shown past pytest's capture).

schemathesis, LiteLLM's SDK and Selenium go into venvs of their own under ``fleet.engines.install.cache_dir()``
(``fleet.engines.install.pip_venv``: pinned, locked, reused), never into the project's environment; an
install that fails is an error, not a skip. curl is a system tool: Debian's package through apt-get when
it is missing, which needs root, so only there, where it cannot be installed, the curl tests skip.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from fleet.engines.install import cache_dir, pip_venv
from loadtest.bench.peers_setup import LITELLM, install_env
from loadtest.bench.tools import SetupError, ensure_tools
from loadtest.chaos.hostile import schemathesis_bin as install_schemathesis
from tests.support.engines import installing

__all__ = ["curl", "litellm_python", "schemathesis_bin", "selenium_python"]

SELENIUM = "selenium==4.50.0"  # drives Debian's Chromium in tests/gateway/test_dashboard_browser.py


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@pytest.fixture(scope="session")
def schemathesis_bin(pytestconfig: pytest.Config) -> Path:
    return installing(pytestconfig, install_schemathesis)


@pytest.fixture(scope="session")
def litellm_python(pytestconfig: pytest.Config) -> Path:
    """The python of the venv `polymorph bench peers` runs LiteLLM from (the same pin, the same folder)."""
    return installing(pytestconfig, lambda: install_env(LITELLM))


@pytest.fixture(scope="session")
def selenium_python(pytestconfig: pytest.Config) -> Path:
    return installing(pytestconfig, lambda: pip_venv(cache_dir() / "browser-venv", (SELENIUM,), "selenium.webdriver"))


@pytest.fixture(scope="session")
def curl(pytestconfig: pytest.Config) -> str:
    try:
        return installing(pytestconfig, lambda: ensure_tools(True, _say, {"curl": "curl"})["curl"])
    except SetupError as problem:
        pytest.skip(str(problem))
