"""Broken state files (the fast subset of `polymorph bench chaos`): a corrupted, then unwritable decision
log under load, and corrupted, locked and full trial stores. The gateway keeps serving, the error is
reported, nothing is silently lost.

Regressions: a full trial store raised sqlite3's "cannot rollback" instead of a StoreError; the
decision log wrote a drift score of inf as non-standard ``Infinity``; a failed decision-log write
raised inside the gateway's event loop and dropped the rest of the batch."""

from __future__ import annotations

import asyncio
from pathlib import Path

from loadtest.chaos.broken_files import broken_decision_log, broken_trial_store
from loadtest.chaos.fleet_faults import FleetFaultSettings


def test_broken_decision_log_under_load(tmp_path: Path) -> None:
    result = asyncio.run(broken_decision_log(tmp_path, FleetFaultSettings(rate_rps=20.0, max_s=40.0)))
    assert result.passed, result.failures()
    assert result.sent > 0 and result.lost == 0 and result.figures["queued_during_outage"] > 0


def test_broken_trial_stores_are_clear_errors(tmp_path: Path) -> None:
    result = asyncio.run(broken_trial_store(tmp_path))
    assert result.passed, result.failures()
    assert result.failed_clear == result.sent == 4
