"""The decision log: every drift, plan, step, verification and rollback with its evidence.

One JSON object a line, ``{"at_unix_s": ..., "kind": ..., "evidence": {...}}`` (the keys that
loadtest/events.py reads), appended to a file when one is given and kept in a bounded in-memory tail
for ``GET /admin/decisions``. Evidence carries what a person needs to answer "why did pool X shrink
at 14:02": the mix before and after, predicted and observed goodput, the plan diff, the reason.

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

KINDS = ("drift", "plan", "step", "verify", "rollback", "recompile", "capacity", "compile", "compiled")


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
    kind: str
    evidence: tuple[tuple[str, Any], ...]  # JSON-able values, in a fixed order
    moves: tuple[Move, ...] = field(default=())

    def to_json(self, clock_offset_s: float = 0.0) -> dict[str, Any]:
        """``clock_offset_s`` maps the controller's clock to Unix time (0 when it already is)."""
        evidence = dict(self.evidence)
        if self.moves:
            evidence["moves"] = [[m.slot, m.from_pool, m.to_pool] for m in self.moves]
        return {"at_unix_s": round(self.at + clock_offset_s, 3), "kind": self.kind, "evidence": evidence}


def decision(at: float, kind: str, moves: tuple[Move, ...] = (), **evidence: Any) -> Decision:
    if kind not in KINDS:
        raise ValueError(f"unknown decision kind {kind!r}")
    return Decision(at, kind, tuple(evidence.items()), moves)


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
