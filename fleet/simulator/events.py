"""The event loop that owns virtual time: a heap keyed ``(time, kind_rank, seq)``.

Handlers take ``(now, payload)`` and return follow-up events as ``(time, kind, payload)``; the loop
pushes them. ``kind_rank`` makes the order of simultaneous events explicit (an iteration that ends at
the instant a request arrives is applied first, so the arrival sees the engine's new state), and
``seq`` is a per-loop counter, so two loops in one process are independent and deterministic.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable
from typing import Any

Event = tuple[float, str, Any]
Handler = Callable[[float, Any], Iterable[Event] | None]


class EventLoop:
    def __init__(self, kind_ranks: tuple[str, ...]) -> None:
        self.kind_to_rank = {kind: rank for rank, kind in enumerate(kind_ranks)}
        self.kind_to_handler: dict[str, Handler] = {}
        self.now = 0.0
        self._heap: list[tuple[float, int, int, str, Any]] = []
        self._seq = 0
        self.num_events = 0

    def on(self, kind: str, handler: Handler) -> None:
        self.kind_to_handler[kind] = handler

    def push(self, at: float, kind: str, payload: Any = None) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (at, self.kind_to_rank[kind], self._seq, kind, payload))

    def run(self, until: float, stop: Callable[[], bool] | None = None) -> None:
        """Run events up to ``until`` (inclusive), or until ``stop()`` holds after an event."""
        heap, handlers = self._heap, self.kind_to_handler
        while heap and heap[0][0] <= until:
            at, _, _, kind, payload = heapq.heappop(heap)
            self.now = at
            self.num_events += 1
            follow = handlers[kind](at, payload)
            if follow:
                for event in follow:
                    self.push(*event)
            if stop is not None and stop():
                return
        self.now = max(self.now, until) if not heap or heap[0][0] > until else self.now
