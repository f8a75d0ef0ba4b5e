"""Shared test fixtures: paths and free loopback ports."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from loadtest.procs import free_port

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared"


@pytest.fixture
def port() -> int:
    return free_port()


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    if not SHARED.is_dir():
        pytest.skip("../shared is not present beside this checkout")
    return SHARED


# Real CPU engines, the tiny model and the client tools, installed on first use (last: the modules import free_port from here).
from tests.support.engines import ENGINE_FIXTURES, engines_installed, install_in_background, llama_server_bin, tiny_gguf, tiny_hf, vllm_python  # noqa: E402,F401
from tests.support.redis import redis  # noqa: E402,F401
from tests.support.tools import curl, litellm_python, redis_server_bin, schemathesis_bin, selenium_python  # noqa: E402,F401


def pytest_configure_node(node: Any) -> None:
    """(xdist's controller) Tell every worker whether the engines are installed, so all order alike."""
    node.workerinput["engines_installed"] = engines_installed()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """vLLM's tests go first when the engines are installed: their group is one worker's longest unit, so the
    other worker takes the rest meanwhile. Otherwise every test on a real engine goes last (vLLM's first among
    them), and the first worker, or a run without workers, installs the engines in the background meanwhile."""
    worker = getattr(config, "workerinput", {"workerid": "gw0", "engines_installed": None})
    installed = worker["engines_installed"] if worker["engines_installed"] is not None else engines_installed()

    def order(item: pytest.Item) -> tuple[bool, bool]:
        needs = ENGINE_FIXTURES & set(item.fixturenames)
        on_vllm = bool(needs & {"vllm_python", "tiny_hf"})
        return (not on_vllm, False) if installed else (bool(needs), not on_vllm)

    items.sort(key=order)  # stable: the collection order otherwise
    if not installed and not config.option.collectonly and worker["workerid"] == "gw0" and any(ENGINE_FIXTURES & set(item.fixturenames) for item in items):
        install_in_background()
