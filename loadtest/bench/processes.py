"""The benchmark's child processes: where they run (CPU pinning) and what they cost (memory, CPU time).

Starting, waiting for and ending them is loadtest.procs's job (its ``ProcessRegistry``).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

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
