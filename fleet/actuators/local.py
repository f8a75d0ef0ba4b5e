"""The local actuator: replicas as child processes on this host.

It starts whatever command the caller names (an emulated replica by default, or a real
``python -m sglang.launch_server`` rendered from a compiled configuration), on a free loopback port,
waits for ``/health``, and stops it by PID. Children are tied to this process's life (Linux
``PR_SET_PDEATHSIG``), so a killed gateway leaves no orphaned replica behind.
"""

from __future__ import annotations

import ctypes
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass  # not Linux: the gateway's shutdown hook still stops its children


# Ports a replica is started on come from below the kernel's ephemeral range (where client sockets
# get their source ports) and above Ray's worker ports (10002-19999 by default). A port the kernel
# hands out for bind(0) is in the ephemeral range, so an outgoing connection may take it as its
# source port between the check and the child's own bind, and the child then cannot listen.
_LOW_PORT = 20000


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default; elsewhere a port that fails to bind is skipped all the same


def _binds(host: str, port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


class _PortWalk:
    """This process's walk up the range from a random start, wrapping: it does not hand out one port
    twice while the first taker is still starting, and two processes (pytest's workers) meet only
    where their walks do. Locked: actuators start replicas from worker threads."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.next_port: int | None = None

    def take(self, host: str, high: int) -> int:
        with self.lock:
            port = self.next_port if self.next_port is not None else _LOW_PORT + secrets.randbelow(high - _LOW_PORT)
            for _ in range(high - _LOW_PORT):
                if port >= high:
                    port = _LOW_PORT
                self.next_port = port + 1
                if _binds(host, port):
                    return port
                port += 1
        raise OSError(f"no free port on {host} in {_LOW_PORT}-{high - 1}")


_WALK = _PortWalk()


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing is bound to now, from ``_PortWalk``; bind(0) where the range is too small."""
    high = _ephemeral_low()
    if high - _LOW_PORT < 1000:
        with socket.socket() as sock:
            sock.bind((host, 0))
            return int(sock.getsockname()[1])
    return _WALK.take(host, high)


@dataclass(frozen=True, slots=True)
class LaunchSpec:
    """One replica to start: its name, the command line (``--host H --port P`` are appended), the
    variables its engine needs on top of this process's environment, and the model a warm-up request
    names (None: no warm-up; a real engine's first request compiles and allocates, a user's should not)."""

    name: str
    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)
    warmup_model: str | None = None


@dataclass(slots=True)
class LocalReplica:
    spec: LaunchSpec
    url: str
    process: subprocess.Popen[bytes]
    log_path: Path
    port_retries: int = 0  # relaunches of its start after a lost port race (``LocalActuator.relaunch_if_port_lost``)
    judged: bool = False  # its exit was judged: once, since the port is free for anyone afterwards


def warm_up(url: str, model: str, timeout_s: float = 120.0) -> bool:
    """One one-token completion: did the engine answer it with 200?"""
    body = json.dumps({"model": model, "prompt": "Hello", "max_tokens": 1}).encode()
    request = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def answers_health(url: str, timeout_s: float = 1.0) -> bool:
    """Does the replica at ``url`` answer ``GET /health`` with 200 (the readiness every engine serves)?"""
    try:
        with urllib.request.urlopen(url + "/health", timeout=timeout_s) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def _lost_its_port(replica: LocalReplica) -> bool:
    """Has the replica's process exited while another process listens on its port? Then it lost the race
    between ``free_port``'s check and its own bind: a parallel process took the port in the second or two
    the engine spends importing (the emulator and the engines exit at once when they cannot bind)."""
    parts = urllib.parse.urlsplit(replica.url)
    try:
        socket.create_connection((parts.hostname, parts.port), timeout=0.5).close()
    except OSError:
        return False
    return True


PORT_RACE_RETRIES = 2  # relaunches of one start that lost its port; a third loss in a row is no race


class LocalActuator:
    def __init__(self, log_dir: Path, host: str = "127.0.0.1", detach: bool = False) -> None:
        self.log_dir = log_dir
        self.host = host
        # detached replicas outlive this process (an out-of-process controller's fleet must survive
        # its crash: a restarted or standby controller adopts them); attached ones die with it
        self.detach = detach
        self.replicas: list[LocalReplica] = []

    def start(self, spec: LaunchSpec) -> LocalReplica:
        port = free_port(self.host)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{spec.name}.log"
        with open(log_path, "ab") as log:
            process = subprocess.Popen(
                [*spec.argv, "--host", self.host, "--port", str(port)],
                stdin=subprocess.DEVNULL,
                env={**os.environ, **spec.env} if spec.env else None,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent if sys.platform.startswith("linux") and not self.detach else None,
                start_new_session=self.detach,
            )
        replica = LocalReplica(spec, f"http://{self.host}:{port}", process, log_path)
        self.replicas.append(replica)
        return replica

    def relaunch_if_port_lost(self, replica: LocalReplica) -> LocalReplica | None:
        """For a replica still starting (never answered): if its process exited while another process
        listens on its port, it lost a race that says nothing of its engine, so its spec starts again on
        another port (returned; the caller tracks it in place of ``replica``) rather than fail the move."""
        if replica.judged or replica.process.poll() is None:
            return None
        replica.judged = True
        if replica.port_retries >= PORT_RACE_RETRIES or not _lost_its_port(replica):
            return None
        print(f"polymorph: replica {replica.spec.name} could not listen on {replica.url}: another process took the port; "
              "starting it on another", file=sys.stderr, flush=True)
        if replica in self.replicas:
            self.replicas.remove(replica)
        again = self.start(replica.spec)
        again.port_retries = replica.port_retries + 1
        return again

    def stop(self, replica: LocalReplica, grace_s: float = 5.0) -> None:
        if replica.process.poll() is None:
            replica.process.terminate()
            try:
                replica.process.wait(grace_s)
            except subprocess.TimeoutExpired:
                replica.process.kill()
                replica.process.wait()
        if replica in self.replicas:
            self.replicas.remove(replica)

    def stop_all(self) -> None:
        for replica in list(self.replicas):
            self.stop(replica)


def emulated_replica_argv(command: Sequence[str], model: str, gpu: str, engine_json: str, speed: float,
                          adapters: Sequence[tuple[str, str]] = ()) -> tuple[str, ...]:
    """The command line of an emulated replica; ``command`` is how to invoke ``polymorph emulate``; ``adapters``
    the LoRA adapters (name, path) its pool holds."""
    return (*command, "--model", model, "--gpu", gpu, "--config", engine_json, "--speed", f"{speed:g}", "--served-model-name", model,
            *(arg for name, path in adapters for arg in ("--adapter", f"{name}={path}")))

