"""Real processes for end-to-end tests: emulated replicas and gateways on loopback.

Starting, waiting and stopping are loadtest.procs's (the benchmarks and the chaos suite use the same);
this module adds the tests' conveniences: a ``Proc`` with its URL and log, polymorph subcommands by name.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from loadtest import procs
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
        procs.stop(self.process)


def start(argv: Sequence[str], port: int, log_path: Path, health: str, *, command: Sequence[str] = POLYMORPH,
          timeout_s: float = 30.0, env: Mapping[str, str] | None = None) -> Proc:
    """Run ``command + argv`` (a polymorph subcommand unless ``command`` names another program) until ``health`` answers."""
    url = f"http://127.0.0.1:{port}"
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    log_path.unlink(missing_ok=True)  # procs.start appends: a reused name's log holds this run only
    try:
        process = procs.start_healthy([*command, *argv], url + health, log_path, timeout_s, env=full_env, cwd=REPO)
    except RuntimeError as problem:
        raise RuntimeError(f"{argv[0] if command is POLYMORPH else command[0]} failed to start: {problem}") from None
    return Proc(process, url, log_path)


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


@contextmanager
def gateway_over(tmp: Path, emulator: Proc, config: Mapping[str, object]) -> Iterator[Proc]:
    """A gateway on ``config`` (written to ``tmp/config.yaml``) in front of ``emulator``; both stop on leaving,
    the emulator also when the gateway does not start."""
    (tmp / "config.yaml").write_text(json.dumps(config))
    try:
        gateway = start_gateway(tmp, ["--config", str(tmp / "config.yaml")])
    except BaseException:
        emulator.stop()
        raise
    with running(gateway, emulator):
        yield gateway
