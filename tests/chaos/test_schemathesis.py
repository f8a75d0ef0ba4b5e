"""schemathesis against the gateway's own OpenAPI document (installed in its own venv, not the project's)."""

from __future__ import annotations

import pytest

from loadtest.chaos.hostile import SCHEMATHESIS_BIN, run_schemathesis
from loadtest.chaos.stack import ChaosStack
from tests.chaos.conftest import BETA_KEY


@pytest.mark.skipif(not SCHEMATHESIS_BIN.exists(), reason=f"schemathesis is not installed at {SCHEMATHESIS_BIN} "
                    "(python3 -m venv ~/.cache/polymorph/schemathesis-venv && that venv's pip install schemathesis)")
def test_schemathesis_finds_no_server_error_or_schema_mismatch(hostile_stack: ChaosStack) -> None:
    code, output = run_schemathesis(hostile_stack.url, BETA_KEY, max_examples=8, seed=1, timeout_s=120)
    assert code == 0, output
