"""schemathesis against the gateway's own OpenAPI document (installed on first use in its own venv, not the project's)."""

from __future__ import annotations

import pytest

from loadtest.chaos.hostile import run_schemathesis
from loadtest.chaos.stack import ChaosStack
from tests.chaos.conftest import BETA_KEY


@pytest.mark.usefixtures("schemathesis_bin")  # installs it with its progress shown; run_schemathesis finds it cached
def test_schemathesis_finds_no_server_error_or_schema_mismatch(hostile_stack: ChaosStack) -> None:
    code, output = run_schemathesis(hostile_stack.url, BETA_KEY, max_examples=8, seed=1, timeout_s=120)
    assert code == 0, output
