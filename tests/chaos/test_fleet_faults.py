"""Fleet faults with the controller on (the fast subset of `polymorph bench chaos`): a step whose replica
hangs at start-up is rolled back to the previous plan, a lost pool overflows and is planned around;
no request is lost or failed."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from loadtest.chaos.fleet_faults import FLEET_SCENARIOS, FleetFaultSettings


@pytest.mark.parametrize("name", sorted(FLEET_SCENARIOS))
def test_fleet_fault_loses_nothing(tmp_path: Path, name: str) -> None:
    result = asyncio.run(FLEET_SCENARIOS[name](tmp_path, FleetFaultSettings(rate_rps=20.0, max_s=90.0)))
    assert result.passed, result.failures()
    assert result.sent > 0 and result.lost == 0 and result.failed_clear == 0
