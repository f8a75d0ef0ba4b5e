"""Fault injection and client disconnects on a real emulator subprocess."""

from __future__ import annotations

import http.client
import json
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from tests.fleet.emulator_helpers import chat_body, get_json, post_json, request
from tests.support.procs import POLYMORPH, Proc, set_faults, start_emulator


@pytest.fixture(scope="module")
def emulator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    proc = start_emulator(tmp_path_factory.mktemp("faults"), "faults", speed=1.0)
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture
def base(emulator: Proc) -> Iterator[str]:
    set_faults(emulator.url, reset=True)
    yield emulator.url
    set_faults(emulator.url, reset=True)


@contextmanager
def _connection(base: str) -> Iterator[http.client.HTTPConnection]:
    host, port = base.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        yield connection
    finally:
        connection.close()


def _send_chat(connection: http.client.HTTPConnection, body: dict[str, object]) -> None:
    connection.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})


def _content_events(response: http.client.HTTPResponse) -> Iterator[tuple[float, str]]:
    """(arrival instant, line) of each SSE data line carrying content."""
    while True:
        line = response.readline()
        if not line:
            return
        if b'"content":"' in line and b'"content":""' not in line:
            yield time.monotonic(), line.decode()


def test_fail_after_requests(base: str) -> None:
    set_faults(base, fail_after_requests=1)
    assert post_json(base, "/v1/chat/completions", chat_body("a", 2))[0] == 200
    status, body = post_json(base, "/v1/chat/completions", chat_body("b", 2))
    assert status == 503 and body["error"]["type"] == "server_error"


def test_error_rate_is_seeded(base: str) -> None:
    def statuses() -> list[int]:
        set_faults(base, error_rate=0.5, error_status=500, seed=4)
        return [post_json(base, "/v1/completions", {"prompt": "x", "max_tokens": 1})[0] for _ in range(12)]

    first = statuses()
    assert set(first) == {200, 500} and statuses() == first


def test_slowdown_stretches_generation(base: str) -> None:
    def elapsed_s() -> float:
        started = time.monotonic()
        assert post_json(base, "/v1/chat/completions", chat_body("slow", 40))[0] == 200
        return time.monotonic() - started

    normal = elapsed_s()
    set_faults(base, slowdown=4.0)
    assert elapsed_s() > 3.0 * normal


def test_hang_before_first_byte(base: str) -> None:
    set_faults(base, hang_before_first_byte_s=0.4)
    started = time.monotonic()
    assert post_json(base, "/v1/chat/completions", chat_body("hang", 1))[0] == 200
    assert time.monotonic() - started >= 0.4


def test_stall_mid_stream(base: str) -> None:
    set_faults(base, stall_after_tokens=3, stall_s=0.5)
    with _connection(base) as connection:
        _send_chat(connection, chat_body("stall", 6, stream=True))
        arrivals = [at for at, _ in _content_events(connection.getresponse())]
    gaps = [later - earlier for earlier, later in zip(arrivals, arrivals[1:], strict=False)]
    assert max(gaps) >= 0.45 and sum(1 for gap in gaps if gap >= 0.45) == 1


def _read_until_cut(connection: http.client.HTTPConnection) -> list[bytes]:
    """Every line of a response that may end without its terminating chunk."""
    response = connection.getresponse()
    lines: list[bytes] = []
    try:
        while line := response.readline():
            lines.append(line)
    except (http.client.IncompleteRead, ConnectionError):
        pass
    return lines


def test_crash_cuts_the_connection_after_k_tokens(base: str) -> None:
    set_faults(base, crash_after_tokens=4, crash_mode="cut")
    with _connection(base) as connection:
        _send_chat(connection, chat_body("crash", 50, stream=True))
        lines = _read_until_cut(connection)
    contents = [json.loads(line[6:])["choices"][0]["delta"].get("content", "") for line in lines if line.startswith(b"data: {")]
    assert len("".join(contents).split()) == 4
    assert b"data: [DONE]\n" not in lines
    assert request(base, "GET", "/health")[0] == 200  # the process lives on


def test_refuse_connections_then_recover(base: str) -> None:
    host, port = base.removeprefix("http://").split(":")
    set_faults(base, refuse_connections_s=0.6)
    time.sleep(0.1)
    with pytest.raises(ConnectionRefusedError), socket.create_connection((host, int(port)), timeout=1):
        pass
    time.sleep(0.8)
    assert request(base, "GET", "/health")[0] == 200


def test_health_status_fault(base: str) -> None:
    set_faults(base, health_status=503)
    assert request(base, "GET", "/health")[0] == 503


def test_unknown_fault_is_a_400(base: str) -> None:
    status, body = post_json(base, "/_emulator/faults", {"explode": True})
    assert status == 400 and "unknown fault" in body["error"]["message"]


@pytest.mark.parametrize("faults", [{"error_status": 200}, {"error_rate": 1.0, "error_status": 302}, {"stall_s": 5.0},
                                    {"stall_after_tokens": 3}, {"stall_after_tokens": 3, "stall_s": 0}])
def test_a_fault_that_would_do_nothing_or_answer_success_is_a_400(base: str, faults: dict[str, object]) -> None:
    status, body = post_json(base, "/_emulator/faults", faults)
    assert status == 400 and "fault" in body["error"]["message"]
    assert get_json(base, "/_emulator/faults")["stall_s"] == 0.0  # nothing of the refused change took


@pytest.mark.parametrize("flags", [["--error-status", "200"], ["--stall-s", "5"], ["--stall-after-tokens", "2"]])
def test_the_cli_refuses_the_same(flags: list[str]) -> None:
    # a process with a deadline: an emulator that accepted the flags would serve until stopped
    done = subprocess.run([*POLYMORPH, "emulate", "--model", "llama-3.1-8b", "--gpu", "H100", "--port", "0", *flags],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "error_status must be an HTTP error status" in done.stdout or "stall_s and stall_after_tokens go together" in done.stdout


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_aborts_within_100_ms(base: str, stream: bool) -> None:
    with _connection(base) as connection:
        _send_chat(connection, chat_body("long", 20_000, stream=stream))
        time.sleep(0.3)
        assert get_json(base, "/_emulator/stats")["num_running"] == 1
        assert connection.sock is not None
        connection.sock.shutdown(socket.SHUT_RDWR)
        closed_at = time.monotonic()
    deadline = closed_at + 2.0
    while get_json(base, "/_emulator/stats")["num_running"] and time.monotonic() < deadline:
        time.sleep(0.01)
    stats = get_json(base, "/_emulator/stats")
    assert stats["num_running"] == 0 and stats["kv_used_tokens"] == 0
    assert stats["last_abort_at"] - closed_at < 0.1


def test_crash_exit_ends_the_process(tmp_path_factory: pytest.TempPathFactory) -> None:
    proc = start_emulator(tmp_path_factory.mktemp("exit"), "exit", speed=1.0,
                          extra=["--crash-after-tokens", "2", "--crash-mode", "exit"])
    try:
        with _connection(proc.url) as connection:
            _send_chat(connection, chat_body("bye", 30, stream=True))
            assert b"data: [DONE]\n" not in _read_until_cut(connection)
        assert proc.process.wait(timeout=5) == 17
    finally:
        proc.stop()
