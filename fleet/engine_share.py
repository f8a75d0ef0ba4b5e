"""Each request's share of its replica's engine time, by processor sharing.

A replica runs its requests in flight together (continuous batching), so no request owns a stretch of
its time; charging each its wall duration would bill a replica-second once per request sharing it.
Processor sharing splits every moment evenly among the requests in flight then: a virtual clock
advances by ``dt / n`` while ``n`` are in flight, and a request's share is the clock's advance between
its start and its end. A lone request gets all the time, idle time is charged to nobody, and the shares
of all requests add up to the replica's busy time. Two floats and a count per replica; O(1) per event.
"""

from __future__ import annotations


class ShareClock:
    """The virtual clock of one replica (times are the caller's monotonic seconds)."""

    __slots__ = ("virtual_s", "num_in_flight", "updated_at")

    def __init__(self) -> None:
        self.virtual_s = 0.0
        self.num_in_flight = 0
        self.updated_at = 0.0

    def _advance(self, now: float) -> None:
        if self.num_in_flight > 0 and now > self.updated_at:
            self.virtual_s += (now - self.updated_at) / self.num_in_flight
        self.updated_at = max(self.updated_at, now)

    def begin(self, now: float) -> float:
        """A request starts on the replica: the mark to hand back to ``end``."""
        self._advance(now)
        self.num_in_flight += 1
        return self.virtual_s

    def end(self, now: float, mark: float) -> float:
        """The request begun at ``mark`` ends: its share of the replica's time, in replica-seconds."""
        self._advance(now)
        self.num_in_flight -= 1
        return self.virtual_s - mark
