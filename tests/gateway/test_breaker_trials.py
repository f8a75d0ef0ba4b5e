"""An ejected replica's trial that decides nothing does not keep the replica out for good.

After its cool-down an ejected replica gets one trial (a request or a health probe), and nothing else is
sent to it while that trial is in flight. A trial can end without a verdict: the replica answers 429
(busy, not broken), or the client leaves mid-stream. The replica must then get its next trial; before,
it stayed in ``probing`` with no request and no probe ever sent to it again (the chaos suite's
crash-exit-restart once waited 45 s for a readmission that never came).

Real gateway and emulated replica on loopback; health probes are off (``health_interval_s`` an hour) so
that requests are the only trials and nothing else can readmit the replica."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.one_replica import KEY, MODEL, chat_status, one_replica, replica_state
from tests.support.procs import Proc, set_faults

COOLDOWN_S = 0.5


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[tuple[Proc, Proc]]:
    upstream = {"connect_timeout_s": 0.5, "first_byte_timeout_s": 5.0, "response_timeout_s": 5.0, "max_attempts": 1, "eject_after_failures": 1,
                "eject_cooldown_s": COOLDOWN_S, "health_interval_s": 3600}
    with one_replica(tmp_path, upstream) as fleet:
        yield fleet


def _health(gateway: Proc) -> str:
    return str(replica_state(gateway)["health"])


def _eject(gateway: Proc, emulator: Proc) -> None:
    set_faults(emulator.url, error_rate=1.0, error_status=503)
    assert chat_status(gateway) == 503 and _health(gateway) == "ejected"
    set_faults(emulator.url, reset=True)
    time.sleep(COOLDOWN_S + 0.2)


def _leave_mid_stream(gateway: Proc) -> None:
    """A streamed request whose client closes the connection once the stream has begun."""
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2000, "stream": True}).encode()
    host, port = gateway.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        assert b"200 OK" in sock.recv(65536)


def _served_again(gateway: Proc) -> list[int]:
    """The statuses of up to 5 requests until one is served (each 0.2 s apart)."""
    statuses: list[int] = []
    while len(statuses) < 5 and 200 not in statuses:
        statuses.append(chat_status(gateway))
        time.sleep(0.2)
    return statuses


def test_a_trial_answered_429_lets_the_next_request_be_the_trial(fleet: tuple[Proc, Proc]) -> None:
    gateway, emulator = fleet
    _eject(gateway, emulator)
    set_faults(emulator.url, error_rate=1.0, error_status=429)
    assert chat_status(gateway) == 429  # the trial: the replica is busy, which says nothing of its health
    set_faults(emulator.url, reset=True)
    assert _served_again(gateway) == [200] and _health(gateway) == "healthy"


def test_a_trial_whose_client_left_mid_stream_lets_the_next_request_be_the_trial(fleet: tuple[Proc, Proc]) -> None:
    gateway, emulator = fleet
    _eject(gateway, emulator)
    set_faults(emulator.url, slowdown=50.0)
    _leave_mid_stream(gateway)
    set_faults(emulator.url, reset=True)
    time.sleep(0.3)  # the gateway sees the client gone and stops the replica's stream
    assert _served_again(gateway) == [200] and _health(gateway) == "healthy"
