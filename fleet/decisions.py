"""The decision log: every drift, plan, step, verification and rollback with its evidence.

One JSON object a line, ``{"at_unix_s": ..., "kind": ..., "evidence": {...}}`` (the keys that
loadtest/events.py reads), appended to a file when one is given and kept in a bounded in-memory tail
for ``GET /admin/decisions``. Evidence carries what a person needs to answer "why did pool X shrink
at 14:02": the mix before and after, predicted and observed goodput, the plan diff, the reason. It is
one typed record per kind (fleet/evidence.py); ``read_decision`` reads a logged entry back into one.

A broken file never stops the controller or the gateway, and nothing is dropped silently: a line
that cannot be written (disk full, read-only, the path is a directory) stays queued, bounded, and is
written first once the file takes writes again; ``write_error`` says why it is behind. ``open``
reads an existing file's newest lines back into the tail and counts the lines it had to skip
(not JSON, or not a decision) in ``num_skipped_lines``.
"""

from __future__ import annotations

import json
import sys
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from fleet.evidence import Evidence, from_json


@dataclass(frozen=True, slots=True)
class Move:
    """One replica slot (a set of GPUs of one kind) leaving ``from_pool`` for ``to_pool``."""

    slot: str
    from_pool: str
    to_pool: str
    config_json: str  # the engine configuration it restarts with

    def reversed(self, old_config_json: str) -> Move:
        return Move(self.slot, self.to_pool, self.from_pool, old_config_json)


@dataclass(frozen=True, slots=True)
class Decision:
    at: float  # seconds on the controller's clock
    evidence: Evidence
    moves: tuple[Move, ...] = field(default=())
    model: str = ""  # the model whose controller decided (fleet.multi); "" when one controller runs alone

    @property
    def kind(self) -> str:
        return self.evidence.kind

    def to_json(self, clock_offset_s: float = 0.0) -> dict[str, Any]:
        """``clock_offset_s`` maps the controller's clock to Unix time (0 when it already is)."""
        evidence = self.evidence.to_json()
        if self.moves:
            evidence["moves"] = [[m.slot, m.from_pool, m.to_pool] for m in self.moves]
        line = {"at_unix_s": round(self.at + clock_offset_s, 3), "kind": self.kind, "evidence": evidence}
        if self.model:  # an added key: readers of the older lines ignore it
            line["model"] = self.model
        return line


@dataclass(frozen=True, slots=True)
class LoggedMove:
    """A move as the log keeps it (its engine configuration is in the plan's ``configs``, not here)."""

    slot: str
    from_pool: str
    to_pool: str


@dataclass(frozen=True, slots=True)
class LoggedDecision:
    """A decision read back from a log line or ``GET /admin/decisions``."""

    at_unix_s: float
    evidence: Evidence
    moves: tuple[LoggedMove, ...] = ()
    model: str = ""  # "" for a line without one (a single controller's, or an older log)

    @property
    def kind(self) -> str:
        return self.evidence.kind


def read_decision(entry: object) -> LoggedDecision | None:
    """The decision a logged entry holds, or None for one that holds none: not an object, no time,
    a kind that is not one of ``KINDS``, evidence that does not fit its record (see fleet/evidence.py)."""
    if not isinstance(entry, Mapping):
        return None
    at_unix_s, raw = entry.get("at_unix_s"), entry.get("evidence")
    if not isinstance(at_unix_s, (int, float)) or isinstance(at_unix_s, bool) or not isinstance(raw, Mapping):
        return None
    evidence = from_json(str(entry.get("kind")), raw)
    moves = raw.get("moves") or []
    # a move is [slot, from_pool, to_pool] (older lines may carry more after those)
    if evidence is None or not isinstance(moves, list) or not all(
        isinstance(m, list) and len(m) >= 3 and all(isinstance(part, str) for part in m[:3]) for m in moves
    ):
        return None
    model = entry.get("model")
    return LoggedDecision(float(at_unix_s), evidence, tuple(LoggedMove(m[0], m[1], m[2]) for m in moves),
                          model if isinstance(model, str) else "")


def read_decisions(entries: Iterable[object]) -> list[LoggedDecision]:
    """The entries that hold a decision, in order; the others are skipped."""
    return [found for found in map(read_decision, entries) if found is not None]


def read_log(path: Path) -> list[LoggedDecision]:
    """The decisions a log file holds, in order; lines that hold none are skipped, as ``DecisionLog.open``
    skips them. Raises OSError when the file cannot be read."""
    with path.open("rb") as lines:
        return read_decisions(map(_parse_line, lines))


class DecisionLog:
    """Appends decisions as JSON lines; ``tail()`` serves the newest ``max_tail`` of them."""

    def __init__(self, path: Path | None = None, max_tail: int = 1000, clock_offset_s: float = 0.0, max_unwritten: int = 10_000) -> None:
        self.path = path
        self.clock_offset_s = clock_offset_s
        self._tail: deque[dict[str, Any]] = deque(maxlen=max_tail)
        self.kind_to_count: dict[str, int] = {}
        self._unwritten: deque[str] = deque()
        self.max_unwritten = max_unwritten
        self.num_dropped = 0  # lines given up on because the file refused writes for too long (counted, reported)
        self.write_error: str | None = None  # why the file is behind, until a write succeeds again
        self.num_skipped_lines = 0  # lines of the file ``open`` could not read back

    def open(self, path: Path | None) -> None:
        """Append to ``path`` from now on; its newest readable lines become the tail."""
        self.path = path
        if path is None or not path.is_file():
            return
        try:
            with path.open("rb") as lines:
                for raw in lines:
                    entry = _parse_line(raw)
                    if entry is None:
                        self.num_skipped_lines += 1 if raw.strip() else 0
                    else:
                        self._tail.append(entry)
        except OSError as exc:
            self._fail(f"cannot read {path}: {exc}")

    def append(self, entry: Decision) -> None:
        line = entry.to_json(self.clock_offset_s)
        self._tail.append(line)
        self.kind_to_count[entry.kind] = self.kind_to_count.get(entry.kind, 0) + 1
        if self.path is None:
            return
        # orjson, as GET /admin/decisions: a non-finite number (a drift score of inf) is null, not the
        # non-standard ``Infinity`` json.dumps writes, which strict JSON readers reject
        self._unwritten.append(orjson.dumps(line, option=orjson.OPT_SORT_KEYS).decode() + "\n")
        try:
            with self.path.open("a", encoding="utf-8") as out:
                while self._unwritten:
                    out.write(self._unwritten[0])
                    out.flush()  # a line leaves the queue only once the file took it
                    self._unwritten.popleft()
        except OSError as exc:
            while len(self._unwritten) > self.max_unwritten:  # memory stays bounded however long the file refuses
                self._unwritten.popleft()
                self.num_dropped += 1
            self._fail(f"cannot write {self.path}: {exc}")
            return
        if self.write_error is not None:
            print(f"polymorph: decision log {self.path} is writable again; queued lines written", file=sys.stderr, flush=True)
        self.write_error = None

    def _fail(self, error: str) -> None:
        if error != self.write_error:  # once per new error, not once per decision
            print(f"polymorph: decision log: {error}; {len(self._unwritten)} line(s) kept queued in memory", file=sys.stderr, flush=True)
        self.write_error = error

    @property
    def num_unwritten(self) -> int:
        return len(self._unwritten)

    def health(self) -> dict[str, Any]:
        """What GET /admin/decisions reports next to the entries."""
        return {"path": None if self.path is None else str(self.path), "write_error": self.write_error,
                "unwritten": self.num_unwritten, "dropped": self.num_dropped, "skipped_lines": self.num_skipped_lines}

    def extend(self, entries: list[Decision]) -> None:
        for entry in entries:
            self.append(entry)

    def tail(self, limit: int | None = None) -> list[dict[str, Any]]:
        items = list(self._tail)
        return items if limit is None else items[-limit:]


def _parse_line(raw: bytes) -> dict[str, Any] | None:
    """One logged decision, or None for a line that is not one (torn write, corruption, hand edits)."""
    try:
        entry = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(entry, dict) or not isinstance(entry.get("kind"), str) or not isinstance(entry.get("evidence"), dict):
        return None
    return entry
