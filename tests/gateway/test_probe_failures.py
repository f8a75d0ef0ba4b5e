"""A replica whose requests all fail while its /health answers 200 is ejected, however few requests per probe it gets.

/health answers for the engine's process, not its generate path (a model that errors on every request
keeps a healthy HTTP server). Before, each probe's 200 cleared the replica's count of failed requests,
so a replica sent fewer than ``eject_after_failures`` requests per ``health_interval_s`` was never ejected
and every request to it paid a retry. Now a run of failures ends with a request served, or a quiet
``eject_cooldown_s`` (fleet/health.py).

Real gateway and emulated replica on loopback; probes every 0.1 s, requests 0.35 s apart (three probes
between any two failures)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.one_replica import chat_status, one_replica, replica_state
from tests.support.procs import Proc, set_faults

EJECT_AFTER = 3


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[tuple[Proc, Proc]]:
    upstream = {"connect_timeout_s": 0.5, "first_byte_timeout_s": 5.0, "response_timeout_s": 5.0, "max_attempts": 1,
                "eject_after_failures": EJECT_AFTER, "eject_cooldown_s": 60, "health_interval_s": 0.1}
    with one_replica(tmp_path, upstream) as fleet:
        yield fleet


def test_failing_requests_eject_a_replica_whose_health_probes_pass(fleet: tuple[Proc, Proc]) -> None:
    gateway, emulator = fleet
    set_faults(emulator.url, error_rate=1.0, error_status=500)  # requests fail; /health still answers 200
    statuses, health = [], []
    for _ in range(EJECT_AFTER):
        time.sleep(0.35)
        statuses.append(chat_status(gateway))
        health.append(replica_state(gateway)["health"])
    assert statuses == [500] * EJECT_AFTER
    assert health == ["healthy"] * (EJECT_AFTER - 1) + ["ejected"]


def test_a_request_served_ends_the_run_of_failures(fleet: tuple[Proc, Proc]) -> None:
    gateway, emulator = fleet
    for _ in range(EJECT_AFTER - 1):
        set_faults(emulator.url, error_rate=1.0, error_status=500)
        assert chat_status(gateway) == 500
        set_faults(emulator.url, reset=True)
        assert chat_status(gateway) == 200
    set_faults(emulator.url, error_rate=1.0, error_status=500)
    assert chat_status(gateway) == 500
    assert replica_state(gateway)["health"] == "healthy"  # one failure in a row, not three
