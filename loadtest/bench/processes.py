"""The benchmark's child processes: start them pinned, wait until they listen, measure, end them.

Each child leads its own process group, so ending it (by its pid) also ends its workers; the
registry ends every child it started, in reverse order, even when the run is interrupted.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

_PAGE_MB = os.sysconf("SC_PAGE_SIZE") / 2**20
_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True, slots=True)
class Pinning:
    """CPU lists for ``taskset -c``; None runs unpinned."""

    client_cpus: str | None
    proxy_cpus: str | None
    backend_cpus: str | None

    def describe(self) -> str:
        if self.proxy_cpus is None:
            return "unpinned"
        return f"load generator+backend on CPU {self.client_cpus}, proxy on CPU {self.proxy_cpus}"


def default_pinning(pin: bool) -> Pinning:
    """Load generator and backend share one core, the proxy under test owns the other.

    Sharing keeps the backend's placement identical for every variant, so its cost cancels out.
    """
    if not pin or shutil.which("taskset") is None or (os.cpu_count() or 1) < 2:
        return Pinning(None, None, None)
    return Pinning(client_cpus="0", proxy_cpus="1", backend_cpus="0")


def pinned(argv: Sequence[str], cpus: str | None) -> list[str]:
    return ["taskset", "-c", cpus, *argv] if cpus is not None else list(argv)


class ProcessRegistry:
    """Owns every long-lived child of a run and ends them all on exit (Ctrl-C included)."""

    def __init__(self, log_dir: Path) -> None:
        self._log_dir = log_dir
        self._children: list[subprocess.Popen[bytes]] = []

    def start(self, name: str, argv: Sequence[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        """Start ``argv`` in its own session, output to ``<log_dir>/<name>.log``."""
        log_path = self._log_dir / f"{name}.log"
        with log_path.open("ab") as log:
            child = subprocess.Popen(
                list(argv), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True, env=env,
            )
        self._children.append(child)
        return child

    def log_tail(self, name: str, num_chars: int = 2000) -> str:
        path = self._log_dir / f"{name}.log"
        return path.read_text(errors="replace")[-num_chars:] if path.exists() else ""

    def stop(self, child: subprocess.Popen[bytes], grace_s: float = 5.0) -> None:
        """End one child and its process group: SIGTERM, then SIGKILL after ``grace_s``."""
        if child in self._children:
            self._children.remove(child)
        if child.poll() is not None:
            return
        _signal_group(child.pid, signal.SIGTERM)
        try:
            child.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            _signal_group(child.pid, signal.SIGKILL)
            child.wait(timeout=grace_s)
        # Workers that outlived their leader still hold the group id.
        _signal_group(child.pid, signal.SIGKILL)

    def stop_all(self) -> None:
        for child in reversed(list(self._children)):
            self.stop(child)

    def __enter__(self) -> ProcessRegistry:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop_all()


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def wait_for_port(port: int, child: subprocess.Popen[bytes], timeout_s: float) -> None:
    """Block until 127.0.0.1:``port`` accepts connections; raise if the child dies or time runs out."""
    deadline_at = time.monotonic() + timeout_s
    while time.monotonic() < deadline_at:
        if child.poll() is not None:
            raise RuntimeError(f"process {child.args!r} exited with {child.returncode} before listening")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listened on 127.0.0.1:{port} within {timeout_s:.0f} s")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def tree_rss_mb(pid: int) -> float:
    """Resident memory of ``pid`` and all its descendants (workers count), in MiB; 0 if gone."""
    return sum(_rss_pages(member) for member in _descendants(pid) | {pid}) * _PAGE_MB


def tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) used so far by ``pid`` and its live descendants; 0 if gone."""
    return sum(_cpu_ticks(member) for member in _descendants(pid) | {pid}) / _TICKS_PER_S


def _cpu_ticks(pid: int) -> int:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0
    fields = stat[stat.rfind(")") + 2 :].split()
    return int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)


def _rss_pages(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def _descendants(root_pid: int) -> set[int]:
    pid_to_parent: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # The command name may hold spaces and parentheses: fields start after the last ')'.
        fields = stat[stat.rfind(")") + 2 :].split()
        pid_to_parent[int(entry.name)] = int(fields[1])
    found: set[int] = set()
    frontier = [root_pid]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, ppid in pid_to_parent.items() if ppid == parent and pid not in found]
        found.update(children)
        frontier.extend(children)
    return found
