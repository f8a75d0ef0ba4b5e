"""Replica faults under live load (the fast subset of `polymorph bench chaos`): nothing is ever lost."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from loadtest.chaos.faults import FAULT_SCENARIOS, FaultRunner, FaultSettings, fault_plan
from loadtest.chaos.stack import ChaosStack


@pytest.fixture(scope="module")
def runner(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultRunner]:
    with ChaosStack(fault_plan(), Path(tmp_path_factory.mktemp("faults"))) as stack:
        runner = FaultRunner(stack, FaultSettings(rate_rps=50.0, duration_s=1.5, reload_rate_rps=150.0))
        baseline = asyncio.run(runner.baseline())
        assert baseline.passed, baseline.failures()
        yield runner


@pytest.mark.parametrize("name", [n for n in FAULT_SCENARIOS if n != "baseline"])
def test_scenario_loses_nothing(runner: FaultRunner, name: str) -> None:
    result = asyncio.run(FAULT_SCENARIOS[name](runner))  # type: ignore[arg-type]
    assert result.passed, result.failures()
    assert result.sent > 0 and result.lost == 0
    if name in ("http-5xx", "hang-before-first-byte", "pool-overflow"):
        assert result.retried > 0  # the fault was hit and the request moved to another replica
