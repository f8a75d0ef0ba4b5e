"""Child processes on loopback, for the benchmarks, the chaos suite, the demo and the tests: start one,
wait (bounded) until it answers, stop it (SIGTERM, then SIGKILL).

A child started with ``new_session`` leads its own process group, so stopping it with ``group`` also
ends its workers (a gateway's ``--workers``, an engine's helpers). Every wait fails with a
``RuntimeError`` naming what did not come up: the benchmarks catch it to report a setup failure.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType

# The product's local actuator picks its replicas' ports the same way; loadtest may import fleet, not the reverse.
from fleet.actuators.local import free_port

__all__ = ["ProcessRegistry", "free_port", "start", "start_healthy", "stop", "wait_for_port", "wait_http"]

_POLL_EVERY_S = 0.05  # loopback probes are cheap; a shorter start-up wait is what matters
_LOG_TAIL_CHARS = 2000


def start(argv: Sequence[str], log_path: Path, *, env: Mapping[str, str] | None = None, cwd: Path | None = None,
          new_session: bool = False) -> subprocess.Popen[bytes]:
    """Run ``argv`` with stdin closed and stdout and stderr appended to ``log_path``; ``env`` replaces the environment."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log:  # the child keeps its own descriptor
        return subprocess.Popen(list(argv), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=dict(env) if env is not None else None, cwd=cwd, start_new_session=new_session)


def _answers_200(url: str, timeout_s: float = 1.0) -> bool:
    """Does ``GET url`` answer 200 within ``timeout_s``?"""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):  # HTTPError (a non-2xx answer) is a URLError
        return False


def wait_http(url: str, process: subprocess.Popen[bytes], timeout_s: float) -> None:
    """Block until ``GET url`` answers 200; raise if ``process`` exits first or ``timeout_s`` runs out."""
    _wait(lambda: _answers_200(url), process, timeout_s, f"{url} did not answer 200")


def wait_for_port(port: int, process: subprocess.Popen[bytes], timeout_s: float) -> None:
    """Block until 127.0.0.1:``port`` accepts connections (a server that serves no health URL, like nginx)."""

    def listens() -> bool:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return True
        except OSError:
            return False

    _wait(listens, process, timeout_s, f"nothing listened on 127.0.0.1:{port}")


def _wait(ready: Callable[[], bool], process: subprocess.Popen[bytes], timeout_s: float, what: str) -> None:
    deadline_at = time.monotonic() + timeout_s
    while time.monotonic() < deadline_at:
        if process.poll() is not None:
            raise RuntimeError(f"{process.args!r} exited with {process.returncode}: {what}")
        if ready():
            return
        time.sleep(_POLL_EVERY_S)
    raise RuntimeError(f"{what} within {timeout_s:g} s")


def stop(process: subprocess.Popen[bytes], grace_s: float = 10.0, *, group: bool = False) -> None:
    """SIGTERM, then SIGKILL if it has not exited after ``grace_s``; ``group``: its whole process group
    (it was started with ``new_session``), including workers that outlive their leader."""
    if process.poll() is None:
        _signal(process, signal.SIGTERM, group)
        try:
            process.wait(grace_s)
        except subprocess.TimeoutExpired:
            _signal(process, signal.SIGKILL, group)
            process.wait(grace_s)
    if group:  # workers that outlived their leader still hold the group id
        _signal(process, signal.SIGKILL, group)


def _signal(process: subprocess.Popen[bytes], sig: signal.Signals, group: bool) -> None:
    try:
        if group:
            os.killpg(process.pid, sig)
        else:
            process.send_signal(sig)
    except (ProcessLookupError, PermissionError):
        pass  # already gone (or its group is)


def start_healthy(argv: Sequence[str], health_url: str, log_path: Path, timeout_s: float, *, env: Mapping[str, str] | None = None,
                  cwd: Path | None = None, new_session: bool = False) -> subprocess.Popen[bytes]:
    """``start`` then ``wait_http(health_url)``; one that does not come up is stopped, and the error ends with its log."""
    process = start(argv, log_path, env=env, cwd=cwd, new_session=new_session)
    try:
        wait_http(health_url, process, timeout_s)
    except RuntimeError as problem:
        stop(process, group=new_session)
        tail = log_path.read_text(errors="replace")[-_LOG_TAIL_CHARS:]
        raise RuntimeError(f"{problem}; the end of {log_path}:\n{tail}") from None
    return process


class ProcessRegistry:
    """Owns every long-lived child of a run and ends them all, in reverse order, on exit (Ctrl-C included).
    Each child leads its own process group and logs to ``<log_dir>/<name>.log``."""

    def __init__(self, log_dir: Path) -> None:
        self._log_dir = log_dir
        self._children: list[subprocess.Popen[bytes]] = []

    def start(self, name: str, argv: Sequence[str], env: Mapping[str, str] | None = None) -> subprocess.Popen[bytes]:
        child = start(argv, self._log_dir / f"{name}.log", env=env, new_session=True)
        self._children.append(child)
        return child

    def log_tail(self, name: str, num_chars: int = _LOG_TAIL_CHARS) -> str:
        path = self._log_dir / f"{name}.log"
        return path.read_text(errors="replace")[-num_chars:] if path.exists() else ""

    def stop(self, child: subprocess.Popen[bytes], grace_s: float = 5.0) -> None:
        """End one child and its process group: SIGTERM, then SIGKILL after ``grace_s``."""
        if child in self._children:
            self._children.remove(child)
        stop(child, grace_s, group=True)

    def stop_all(self) -> None:
        for child in reversed(list(self._children)):
            self.stop(child)

    def __enter__(self) -> ProcessRegistry:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop_all()
