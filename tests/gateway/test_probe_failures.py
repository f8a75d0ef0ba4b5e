"""A replica whose requests all fail while its /health answers 200 is ejected, however few requests per probe it gets.

/health answers for the engine's process, not its generate path (a model that errors on every request
keeps a healthy HTTP server). Before, each probe's 200 cleared the replica's count of failed requests,
so a replica sent fewer than ``eject_after_failures`` requests per ``health_interval_s`` was never ejected
and every request to it paid a retry. Now a run of failures ends with a request served, or a quiet
``eject_cooldown_s`` (fleet/health.py).

Real gateway and emulated replica on loopback; probes every 0.1 s, requests 0.35 s apart (three probes
between any two failures)."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.procs import Proc, gateway_over, set_faults, start_emulator, write_tenant

MODEL, KEY, ADMIN = "llama-3.1-8b", "sk-test-probes", "admin-token-for-tests"
EJECT_AFTER = 3


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[tuple[Proc, Proc]]:
    emulator = start_emulator(tmp_path, "emu")
    (tmp_path / "tenants").mkdir()
    write_tenant(tmp_path / "tenants", "main", KEY, max_concurrency=100, rate_limits={"requests_per_min": 100000})
    config = {
        "server": {"admin_token": ADMIN, "access_log": False},
        "upstream": {"connect_timeout_s": 0.5, "first_byte_timeout_s": 5.0, "max_attempts": 1,
                     "eject_after_failures": EJECT_AFTER, "eject_cooldown_s": 60, "health_interval_s": 0.1},
        "tenants_dir": "tenants",
        "fleet": {"pools": [{"name": "main", "model": MODEL, "shapes": ["short-chat", "long-context", "reasoning", "batch"],
                             "replicas": {"urls": [emulator.url]}}]},
    }
    with gateway_over(tmp_path, emulator, config) as gateway:
        yield gateway, emulator


def _chat(gateway: Proc) -> int:
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}).encode()
    request = urllib.request.Request(gateway.url + "/v1/chat/completions", data=body, method="POST",
                                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            resp.read()
            return int(resp.status)
    except urllib.error.HTTPError as err:
        err.close()
        return err.code


def _replica(gateway: Proc) -> dict[str, object]:
    request = urllib.request.Request(gateway.url + "/admin/state", headers={"Authorization": f"Bearer {ADMIN}"})
    with urllib.request.urlopen(request, timeout=5) as resp:
        return json.loads(resp.read())["pools"][0]["replicas"][0]  # type: ignore[no-any-return]


def test_failing_requests_eject_a_replica_whose_health_probes_pass(fleet: tuple[Proc, Proc]) -> None:
    gateway, emulator = fleet
    set_faults(emulator.url, error_rate=1.0, error_status=500)  # requests fail; /health still answers 200
    statuses, health = [], []
    for _ in range(EJECT_AFTER):
        time.sleep(0.35)
        statuses.append(_chat(gateway))
        health.append(_replica(gateway)["health"])
    assert statuses == [500] * EJECT_AFTER
    assert health == ["healthy"] * (EJECT_AFTER - 1) + ["ejected"]


def test_a_request_served_ends_the_run_of_failures(fleet: tuple[Proc, Proc]) -> None:
    gateway, emulator = fleet
    for _ in range(EJECT_AFTER - 1):
        set_faults(emulator.url, error_rate=1.0, error_status=500)
        assert _chat(gateway) == 500
        set_faults(emulator.url, reset=True)
        assert _chat(gateway) == 200
    set_faults(emulator.url, error_rate=1.0, error_status=500)
    assert _chat(gateway) == 500
    assert _replica(gateway)["health"] == "healthy"  # one failure in a row, not three
