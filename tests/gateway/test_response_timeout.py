"""A non-streamed answer arrives whole, so its first byte is its last: it has ``response_timeout_s``, and a
stream's first chunk ``first_byte_timeout_s``. Before, both had the latter (120 s by default), so a long
generation (a reasoning model's thousands of tokens) was cut, retried from scratch on another replica, and
counted as that replica's failure: a few such requests ejected healthy replicas.

Real gateway and emulated replica on loopback; the replica holds every answer back 1.5 s."""

from __future__ import annotations

from pathlib import Path

from tests.support.one_replica import chat_status, one_replica, replica_state
from tests.support.procs import set_faults


def test_a_non_streamed_answer_has_the_response_timeout_and_a_stream_the_first_byte_timeout(tmp_path: Path) -> None:
    upstream = {"first_byte_timeout_s": 0.5, "response_timeout_s": 10.0, "max_attempts": 1, "eject_after_failures": 2,
                "health_interval_s": 3600}
    with one_replica(tmp_path, upstream) as (gateway, emulator):
        set_faults(emulator.url, hang_before_first_byte_s=1.5)
        assert [chat_status(gateway) for _ in range(3)] == [200] * 3  # each took 1.5 s: past the first-byte timeout
        assert replica_state(gateway)["failures"] == 0
        assert chat_status(gateway, stream=True) == 504  # a stream's first chunk is late
        assert replica_state(gateway)["failures"] == 1
