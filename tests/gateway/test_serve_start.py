"""`polymorph serve` says "serving on" only when it does: a request or a Ctrl-C sent the moment the line
appears is honoured, with one process and with `--workers 2`.

Before, the line came before the socket listened and before the signal handlers were in place: a curl
sent on seeing it was refused, and a SIGINT then ended the process with a traceback.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from loadtest.chaos.fleet_faults import write_fleet_config
from tests.conftest import REPO, free_port
from tests.support.procs import POLYMORPH, start_emulator


def _serve_until_announced(upstream: str, workers: int) -> tuple[subprocess.Popen[bytes], str, str]:
    port = free_port()
    process = subprocess.Popen([*POLYMORPH, "serve", "--upstream", upstream, "--port", str(port), "--workers", str(workers)],
                               cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    assert process.stderr is not None
    said = ""
    deadline = time.monotonic() + 60
    while "serving on" not in said:
        line = process.stderr.readline().decode(errors="replace")
        assert line and time.monotonic() < deadline, f"no 'serving on' line; the gateway said: {said}"
        said += line
    return process, f"http://127.0.0.1:{port}", said


@pytest.mark.parametrize("workers", [1, 2])
def test_serving_on_means_it_answers_and_a_ctrl_c_at_once_stops_it(tmp_path: Path, workers: int) -> None:
    emulator = start_emulator(tmp_path, "upstream")
    try:
        process, url, _ = _serve_until_announced(emulator.url, workers)
        with process:
            try:
                with urllib.request.urlopen(url + "/healthz", timeout=5) as resp:  # no retry: the line is the promise
                    assert resp.status == 200
            finally:
                process.send_signal(signal.SIGTERM)
        process, url, _ = _serve_until_announced(emulator.url, workers)
        with process:
            process.send_signal(signal.SIGINT)
            try:
                _, rest = process.communicate(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                pytest.fail("a SIGINT sent on 'serving on' did not stop the gateway in 20 s")
        assert process.returncode == 0, rest.decode(errors="replace")
        assert b"Traceback" not in rest, rest.decode(errors="replace")
    finally:
        emulator.stop()



@pytest.mark.parametrize("command", ["serve", "controller"])
def test_an_address_in_use_fails_at_once_before_any_replica_starts(tmp_path: Path, command: str) -> None:
    """Before, the config's replicas started first and the gateway (or the external controller) found its
    port taken after them: with real engines, after their weights had loaded."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    controller = {"enabled": True, "mode": "external", "url": url, "state_file": "controller.json"} if command == "controller" else {}
    config = write_fleet_config(tmp_path, (("mixed", 2, ("short-chat",)),), controller)
    argv = ["serve", "--config", str(config), "--port", str(port)] if command == "serve" else ["controller", "--config", str(config)]
    with socket.create_server(("127.0.0.1", port)):  # someone else listens there
        done = subprocess.run([*POLYMORPH, *argv], cwd=REPO, capture_output=True, timeout=60, check=False)
    said = done.stderr.decode(errors="replace")
    assert done.returncode == 2, said
    assert said.strip().splitlines()[-1] == f"polymorph: cannot listen on {url}: Address already in use"
    assert "starting" not in said and not (tmp_path / "controller.json").exists()  # no replica started, no state written
