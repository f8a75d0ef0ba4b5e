"""Overload is shed at once with Retry-After (the lowest tier first) and memory stays flat; idle streams cost
little and stall no one."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from loadtest.chaos.pressure import (
    OverloadSettings,
    idle_plan,
    idle_streams,
    overload,
    overload_plan,
    raise_fd_limit,
    tier_overload,
    tier_overload_plan,
)
from loadtest.chaos.stack import ChaosStack


@pytest.mark.serial  # "shed within 100 ms" is a wall-clock bound: another worker's load on two cores is noise
def test_3x_overload_is_shed_fast_and_recovers(tmp_path: Path) -> None:
    with ChaosStack(overload_plan(), tmp_path) as stack:
        result = asyncio.run(overload(stack, OverloadSettings(overload_s=3.0, recovery_s=2.0)))
    assert result.passed, result.failures()
    assert result.figures["shed"] > 0


@pytest.mark.serial
def test_3x_overload_sheds_batch_and_interactive_keeps_its_latency(tmp_path: Path) -> None:
    """Regression: the gateway did not hand the tiers to the router, so nothing was shed and interactive
    queued behind batch in the replicas (p99 7 s against a 143 ms baseline)."""
    with ChaosStack(tier_overload_plan(), tmp_path) as stack:
        result = asyncio.run(tier_overload(stack, OverloadSettings(overload_s=6.0, recovery_s=2.0)))
    assert result.passed, result.failures()
    assert result.figures["batch_shed"] > 0 and result.lost == 0


def test_idle_streams_and_slow_readers(tmp_path: Path) -> None:
    num_streams = 1500
    if raise_fd_limit(4 * num_streams) < 2 * num_streams + 1024:
        pytest.skip("the open-file limit is too low for this test")
    with ChaosStack(idle_plan(), tmp_path) as stack:
        result = asyncio.run(idle_streams(stack, num_streams))
    assert result.passed, result.failures()
