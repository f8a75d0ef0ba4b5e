"""Real processes for end-to-end tests: emulated replicas and gateways on loopback."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.conftest import REPO, free_port

POLYMORPH = (sys.executable, "-m", "gateway.cli")


@dataclass
class Proc:
    process: subprocess.Popen[bytes]
    url: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


def wait_http(url: str, timeout_s: float = 30.0, process: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"process exited with {process.returncode} before {url} answered")
        try:
            with urllib.request.urlopen(url, timeout=1.0) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            time.sleep(0.05)
    raise TimeoutError(f"{url} did not answer within {timeout_s} s")


def start(argv: Sequence[str], port: int, log_path: Path, health: str, *, command: Sequence[str] = POLYMORPH,
          timeout_s: float = 30.0, env: Mapping[str, str] | None = None) -> Proc:
    """Run ``command + argv`` (a polymorph subcommand unless ``command`` names another program) until ``health`` answers."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    with open(log_path, "wb") as log:  # the child keeps its own descriptor
        process = subprocess.Popen([*command, *argv], cwd=REPO, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=full_env)
    proc = Proc(process, f"http://127.0.0.1:{port}", log_path)
    try:
        wait_http(proc.url + health, timeout_s, process=process)
    except Exception:
        proc.stop()
        raise RuntimeError(f"{argv[0] if command is POLYMORPH else command[0]} failed to start:\n{proc.log()}") from None
    return proc


def start_emulator(tmp: Path, name: str, gpu: str = "H100-SXM", speed: float = 20.0, model: str = "llama-3.1-8b", extra: Sequence[str] = ()) -> Proc:
    port = free_port()
    argv = ["emulate", "--model", model, "--gpu", gpu, "--port", str(port), "--speed", str(speed), *extra]
    return start(argv, port, tmp / f"{name}.log", "/health")


def start_gateway(tmp: Path, argv: Sequence[str], name: str = "gateway", timeout_s: float = 30.0) -> Proc:
    port = free_port()
    return start(["serve", *argv, "--port", str(port)], port, tmp / f"{name}.log", "/healthz", timeout_s=timeout_s)


def set_faults(emulator_url: str, **faults: object) -> None:
    request = urllib.request.Request(emulator_url + "/_emulator/faults", data=json.dumps(faults).encode(), method="POST", headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=5) as resp:
        assert resp.status == 200


def write_tenant(directory: Path, name: str, key: str, **fields: object) -> None:
    body = {"name": name, "api_key_sha256": [hashlib.sha256(key.encode()).hexdigest()], **fields}
    (directory / f"{name}.yaml").write_text(json.dumps(body))  # JSON is YAML


@contextmanager
def running(*procs: Proc) -> Iterator[None]:
    try:
        yield
    finally:
        for proc in procs:
            proc.stop()
