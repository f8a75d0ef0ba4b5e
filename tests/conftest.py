"""Shared test fixtures: paths and free loopback ports."""

from __future__ import annotations

from pathlib import Path

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
from tests.support.engines import ENGINE_FIXTURES, install_in_background, llama_server_bin, tiny_gguf, tiny_hf, vllm_python  # noqa: E402,F401
from tests.support.redis import redis  # noqa: E402,F401
from tests.support.tools import curl, litellm_python, redis_server_bin, schemathesis_bin, selenium_python  # noqa: E402,F401


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The tests on real engines run last (vLLM's first among them: its group is one worker's long unit), and
    the first worker, or a run without workers, installs the engines in the background meanwhile."""

    def engines_last(item: pytest.Item) -> tuple[bool, bool]:
        needs = ENGINE_FIXTURES & set(item.fixturenames)
        return bool(needs), "vllm_python" not in needs and "tiny_hf" not in needs

    items.sort(key=engines_last)  # stable: the collection order otherwise
    on_engines = any(ENGINE_FIXTURES & set(item.fixturenames) for item in items)
    if on_engines and getattr(config, "workerinput", {"workerid": "gw0"})["workerid"] == "gw0":
        install_in_background()
