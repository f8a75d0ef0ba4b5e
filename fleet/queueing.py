"""A bounded, deadline-aware priority queue per pool: who waits, who is served next, who is shed.

When a pool is saturated the gateway parks requests here instead of sending them to an engine
whose queue would make everyone miss. ``offer`` admits a request with its tier priority (0 first)
and the instant its TTFT objective expires; when the queue is full the least urgent entry (lowest
priority, then latest deadline) is shed, which may be the newcomer itself, so ``batch`` is shed
before ``interactive`` waits. ``take(now)`` returns the most urgent live entry and sheds the ones
whose deadline has passed (they would miss their SLO anyway; shedding them early with 429 and
``Retry-After`` lets the client back off). ``num_ahead(priority)`` counts the live entries a newcomer
of that priority would wait behind (the router's SLO-chance estimate reads it); ``expire(now)`` sheds
every entry past its deadline, wherever it sits; ``remove(item)`` takes out one that gave up waiting (a
client that went away). Pure: the caller passes ``now``; O(log n) per call (``expire`` is O(n)).
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Generic, TypeVar

Item = TypeVar("Item")


@dataclass(frozen=True, slots=True)
class Shed(Generic[Item]):
    item: Item
    reason: str  # "queue full" or "deadline passed"
    retry_after_s: float


@dataclass(order=True, slots=True)
class _Entry(Generic[Item]):
    priority: int
    deadline_at: float
    seq: int
    item: Item = field(compare=False)
    live: bool = field(default=True, compare=False)


class PoolQueue(Generic[Item]):
    def __init__(self, max_len: int, retry_after_s: float = 1.0) -> None:
        if max_len < 1:
            raise ValueError(f"queue max_len must be >= 1, got {max_len}")
        self.max_len = max_len
        self.retry_after_s = retry_after_s
        self._urgent: list[_Entry[Item]] = []  # min-heap: most urgent first
        self._least: list[tuple[int, float, int, _Entry[Item]]] = []  # min-heap of (-priority, -deadline, -seq)
        self._seq = itertools.count()
        self._num_live = 0
        self._priority_to_num: dict[int, int] = {}
        self._entry_of: dict[Item, _Entry[Item]] = {}  # live entries by item, for remove

    def __len__(self) -> int:
        return self._num_live

    def offer(self, item: Item, priority: int, deadline_at: float) -> Shed[Item] | None:
        """Queue ``item``; returns what was shed to make room (possibly ``item`` itself), else None."""
        entry = _Entry(priority, deadline_at, next(self._seq), item)
        if self._num_live >= self.max_len:
            worst = self._peek_least()
            if worst is None or (worst.priority, worst.deadline_at) <= (priority, deadline_at):
                return Shed(item, "queue full", self.retry_after_s)
            self._remove(worst)
            shed: Shed[Item] | None = Shed(worst.item, "queue full", self.retry_after_s)
        else:
            shed = None
        heapq.heappush(self._urgent, entry)
        heapq.heappush(self._least, (-priority, -deadline_at, -entry.seq, entry))
        self._num_live += 1
        self._priority_to_num[priority] = self._priority_to_num.get(priority, 0) + 1
        self._entry_of[item] = entry
        return shed

    def num_ahead(self, priority: int) -> int:
        """Live entries served before a newcomer of ``priority`` (its own priority and the more urgent ones)."""
        return sum(n for p, n in self._priority_to_num.items() if p <= priority)

    def head_priority(self) -> int | None:
        """The priority of the entry ``take`` would consider first (None: the queue is empty)."""
        while self._urgent and not self._urgent[0].live:
            heapq.heappop(self._urgent)
        return self._urgent[0].priority if self._urgent else None

    def take(self, now: float) -> tuple[Item | None, list[Shed[Item]]]:
        """The most urgent entry still within its deadline, and the entries shed because theirs passed."""
        expired: list[Shed[Item]] = []
        while self._urgent:
            entry = heapq.heappop(self._urgent)
            if not entry.live:
                continue
            self._remove(entry)
            if entry.deadline_at < now:
                expired.append(Shed(entry.item, "deadline passed", self.retry_after_s))
                continue
            return entry.item, expired
        return None, expired

    def expire(self, now: float) -> list[Shed[Item]]:
        """Shed every live entry whose deadline has passed (a lower-priority one may sit behind live ones)."""
        expired = [e for e in self._urgent if e.live and e.deadline_at < now]
        for entry in expired:
            self._remove(entry)
        return [Shed(e.item, "deadline passed", self.retry_after_s) for e in sorted(expired)]

    def remove(self, item: Item) -> bool:
        """Take ``item`` out of the queue at once; False when it is not waiting there (served or shed already)."""
        entry = self._entry_of.get(item)
        if entry is None:
            return False
        self._remove(entry)
        return True

    def _remove(self, entry: _Entry[Item]) -> None:
        if self._entry_of.get(entry.item) is entry:
            del self._entry_of[entry.item]
        entry.live = False
        self._num_live -= 1
        self._priority_to_num[entry.priority] -= 1

    def _peek_least(self) -> _Entry[Item] | None:
        while self._least and not self._least[0][3].live:
            heapq.heappop(self._least)
        return self._least[0][3] if self._least else None
