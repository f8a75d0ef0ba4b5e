"""How many urgent requests a pool has had in flight at once lately: what ``urgent_reserve`` keeps room for.

A static ``router.urgent_reserve`` share keeps a fixed number of each replica's running slots from
batch requests. On one real vLLM replica (``polymorph bench priority``) that was not enough: an
interactive request runs for several engine steps, the next one arrives before it ends, and with
both in flight the single reserved slot is taken, so the newcomer waits in the gateway's queue
until a batch request finishes (a whole batch answer). The reserve must cover the urgent requests
that are in flight together, which depends on the traffic and on how fast the engine is now.

``UrgentDemand`` measures it: the gateway calls ``begin`` and ``end`` around every request of a tier
more urgent than ``shed_priority`` on the pool, and ``peak(now)`` is the most of them in flight at
once within the last ``window_s`` (0 when none came). ``fleet.router_steps.slots_per_replica`` then
keeps that many slots per replica from batch, plus one for the next arrival. Pure: the caller passes
``now``; O(1) amortised per call (a sliding-window maximum).
"""

from __future__ import annotations

from collections import deque


class UrgentDemand:
    def __init__(self, window_s: float) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self.window_s = window_s
        self.num_in_flight = 0
        # (until when, how many were in flight), counts strictly decreasing from the left: the
        # window's maximum is the first entry not older than the window.
        self._marks: deque[tuple[float, int]] = deque()

    def begin(self, now: float) -> None:
        self.num_in_flight += 1
        self._mark(now)

    def end(self, now: float) -> None:
        self._mark(now)  # the count it leaves was held until now
        self.num_in_flight -= 1

    def _mark(self, now: float) -> None:
        while self._marks and self._marks[-1][1] <= self.num_in_flight:
            self._marks.pop()
        self._marks.append((now, self.num_in_flight))

    def peak(self, now: float) -> int:
        """The most urgent requests in flight at once from ``now - window_s`` to ``now``."""
        while self._marks and self._marks[0][0] < now - self.window_s:
            self._marks.popleft()
        return max(self.num_in_flight, self._marks[0][1] if self._marks else 0)
