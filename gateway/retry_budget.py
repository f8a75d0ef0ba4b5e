"""The retry budget: how many failed attempts the gateway may send again, so retries cannot amplify an outage."""

from __future__ import annotations

import math
from collections import deque


class RetryBudget:
    """Retries may add at most ``ratio`` of the requests of the last ``window_s`` seconds, plus
    ``floor_per_s`` over that window (Finagle's RetryBudget: a 10 s ttl, a floor of retries per second).

    Counted over a window, not refilled into a small bucket, because retries come in bursts: a
    replica that starts failing fails the requests sent to it before it is ejected, and each then
    wants another replica at once. A bucket of 10 refused 3 of 14 such retries in a CI run of the
    http-5xx chaos scenario while two healthy replicas of the same model were there to take them;
    with the breaker held off at 150 req/s it refused 43 of 113 (none now). The window holds the
    ratio of every request of the last 10 s. Sustained, the rate stays bounded as before: over any window,
    retries are at most ``floor_per_s * window_s + ratio * requests``. ``ratio`` comes with each
    spend, from the config that request runs on, so a reload changes it at once.
    """

    __slots__ = ("reserve", "slot_s", "num_slots", "_slots")

    def __init__(self, floor_per_s: float = 5.0, window_s: float = 10.0, num_slots: int = 10) -> None:
        self.reserve = floor_per_s * window_s
        self.slot_s = window_s / num_slots
        self.num_slots = num_slots
        self._slots: deque[list[int]] = deque()  # [slot index, requests, retries], oldest first

    def _slot(self, now: float) -> list[int]:
        index = math.floor(now / self.slot_s)
        if not self._slots or self._slots[-1][0] != index:
            while self._slots and self._slots[0][0] <= index - self.num_slots:
                self._slots.popleft()
            self._slots.append([index, 0, 0])
        return self._slots[-1]

    def on_request(self, now: float) -> None:
        self._slot(now)[1] += 1

    def try_spend(self, now: float, ratio: float) -> bool:
        """Spend one retry if the window's balance holds one; False: the failure goes to the client."""
        slot = self._slot(now)
        balance = self.reserve + sum(ratio * s[1] - s[2] for s in self._slots)
        if balance < 1.0:
            return False
        slot[2] += 1
        return True
