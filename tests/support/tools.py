"""Client tools the tests drive, installed on first use like the engines (progress shown past pytest's capture).

redis-server (the shared limits store of tests/gateway/test_shared_limits.py) is Debian's package, installed
through apt-get like curl; it is not optional there, so an install that fails is an error.

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

__all__ = ["curl", "kubectl", "kubernetes_validate_bin", "litellm_python", "redis_server_bin", "schemathesis_bin", "selenium_python"]

# validates tests/deploy/'s Kubernetes manifests against the API server's schemas (its own venv, like schemathesis)
KUBERNETES_VALIDATE = "kubernetes-validate==1.37.0"
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


@pytest.fixture(scope="session")
def redis_server_bin(pytestconfig: pytest.Config) -> str:
    """Debian's redis-server, installed with apt-get on first use; a failed install fails the test."""
    try:
        return installing(pytestconfig, lambda: ensure_tools(True, _say, {"redis-server": "redis-server"})["redis-server"])
    except SetupError as problem:
        pytest.fail(f"redis-server is needed and could not be installed: {problem}")


@pytest.fixture(scope="session")
def kubectl(pytestconfig: pytest.Config) -> str:
    """kubectl, for its offline `kubectl kustomize`: Debian's kubernetes-client through apt-get when it is missing."""
    return installing(pytestconfig, lambda: ensure_tools(True, _say, {"kubectl": "kubernetes-client"})["kubectl"])


@pytest.fixture(scope="session")
def kubernetes_validate_bin(pytestconfig: pytest.Config) -> Path:
    """The `kubernetes-validate` command (schemas of Kubernetes 1.x releases bundled; no cluster needed)."""
    python = installing(pytestconfig, lambda: pip_venv(cache_dir() / "kubernetes-validate-venv", (KUBERNETES_VALIDATE,), "kubernetes_validate"))
    return python.parent / "kubernetes-validate"
