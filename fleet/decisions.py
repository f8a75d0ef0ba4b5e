"""The decision log: every drift, plan, step, verification and rollback with its evidence.

One JSON object a line, ``{"at_unix_s": ..., "kind": ..., "evidence": {...}}`` (the keys that
loadtest/events.py reads), appended to a file when one is given and kept in a bounded in-memory tail
for ``GET /admin/decisions``. Evidence carries what a person needs to answer "why did pool X shrink
at 14:02": the mix before and after, predicted and observed goodput, the plan diff, the reason.
"""

from __future__ import annotations

import json
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

KINDS = ("drift", "plan", "step", "verify", "rollback", "recompile")


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

    def __init__(self, path: Path | None = None, max_tail: int = 1000, clock_offset_s: float = 0.0) -> None:
        self.path = path
        self.clock_offset_s = clock_offset_s
        self._tail: deque[dict[str, Any]] = deque(maxlen=max_tail)
        self.kind_to_count: dict[str, int] = {}

    def append(self, entry: Decision) -> None:
        line = entry.to_json(self.clock_offset_s)
        self._tail.append(line)
        self.kind_to_count[entry.kind] = self.kind_to_count.get(entry.kind, 0) + 1
        if self.path is not None:
            with self.path.open("a", encoding="utf-8") as out:
                out.write(json.dumps(line, sort_keys=True) + "\n")

    def extend(self, entries: list[Decision]) -> None:
        for entry in entries:
            self.append(entry)

    def tail(self, limit: int | None = None) -> list[dict[str, Any]]:
        items = list(self._tail)
        return items if limit is None else items[-limit:]
