"""Foreign load in the plan: the share of a pool's replicas that requests not sent by the gateway hold.

Another gateway or client may load the replicas directly. The gateway's telemetry sees only its own
requests, so a plan made from it credits each replica with its whole capacity and overestimates what
is left for the gateway's traffic. The engines' own figures (``SlotState.engine``, each replica's
last ``/metrics`` scrape) show the rest: what an engine holds (running + waiting) beyond the gateway's
own requests in flight there is foreign.

``ForeignLoad.observe(now, slots)`` takes each tick's per-pool mean of that over the pool's live slots
with engine figures; ``per_replica(now)`` is the mean of those samples over the last ``window_s``
(the telemetry window, so the plan's demand and the foreign load it subtracts cover the same time),
at least 0. A pool none of whose slots reported figures in the window is absent: no figures, no
discount. Unlike the router's per-replica count (``fleet.router.foreign_requests``) a sample is not
clamped at 0: the engine's figures are up to a scrape interval older than the gateway's count at the
snapshot, and that skew, either way, cancels in the mean only if it is kept; clamping each sample
would turn the gateway's own churn into foreign load.

``foreign_shares`` turns that into a share of the plan's per-replica concurrency and ``discounted``
scales each pool option's rate per replica by ``1 - share``: the planner then credits a replica only
with what the foreign load leaves. Pure: the clock is the caller's ``now``.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from fleet.options import Options
from fleet.rollout import SlotState

# A replica keeps at least this share of its capacity for the plan: the planner needs a positive rate,
# and an engine full of foreign requests still finishes some of ours (processor sharing, not exclusion).
MIN_LEFT_SHARE = 0.1


@dataclass(frozen=True, slots=True)
class ForeignSample:
    """One tick's foreign requests per replica, per pool (only pools with a slot that had engine figures;
    negative when the engines' older figures held fewer requests than the gateway has in flight now)."""

    at: float
    pool_to_foreign_per_replica: tuple[tuple[str, float], ...]


def sample(now: float, slots: Iterable[SlotState]) -> ForeignSample:
    """Each pool's mean of engine requests less the gateway's in flight, over its live slots with engine figures."""
    pool_to_counts: dict[str, list[int]] = {}
    for slot in slots:
        if slot.alive and slot.engine is not None:
            pool_to_counts.setdefault(slot.pool, []).append(slot.engine.num_requests - slot.num_in_flight)
    return ForeignSample(now, tuple(sorted((pool, sum(c) / len(c)) for pool, c in pool_to_counts.items())))


class ForeignLoad:
    """The tick samples of the last ``window_s`` and their per-pool mean."""

    def __init__(self, window_s: float) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self.window_s = window_s
        self._samples: deque[ForeignSample] = deque()

    def observe(self, now: float, slots: Iterable[SlotState]) -> None:
        self._samples.append(sample(now, slots))
        self._forget(now)

    def per_replica(self, now: float) -> dict[str, float]:
        """Per pool: foreign requests per replica, the mean of the window's samples that had figures for it (>= 0)."""
        self._forget(now)
        pool_to_values: dict[str, list[float]] = {}
        for found in self._samples:
            for pool, value in found.pool_to_foreign_per_replica:
                pool_to_values.setdefault(pool, []).append(value)
        return {pool: max(0.0, sum(values) / len(values)) for pool, values in sorted(pool_to_values.items())}

    def _forget(self, now: float) -> None:
        while self._samples and self._samples[0].at <= now - self.window_s:
            self._samples.popleft()


def foreign_shares(options: Options, pool_to_foreign_per_replica: Mapping[str, float]) -> dict[str, float]:
    """Per planned pool with foreign load: foreign requests per replica over the plan's concurrency per
    replica, clamped to ``[0, 1 - MIN_LEFT_SHARE]``. A pool without foreign load is absent."""
    out: dict[str, float] = {}
    for pool, concurrency in options.pool_to_concurrency:
        foreign = pool_to_foreign_per_replica.get(pool, 0.0)
        if foreign > 0 and concurrency > 0:
            out[pool] = min(1.0 - MIN_LEFT_SHARE, foreign / concurrency)
    return out


def discounted(options: Options, pool_to_share: Mapping[str, float]) -> Options:
    """``options`` with each pool's rate per replica (every shape it serves) scaled by ``1 - share``."""
    if not pool_to_share:
        return options
    pools = tuple(
        dataclasses.replace(option, serves=tuple(dataclasses.replace(s, rate_per_replica_rps=s.rate_per_replica_rps * (1.0 - share))
                                                 for s in option.serves))
        if (share := pool_to_share.get(option.name, 0.0)) > 0 else option
        for option in options.pools)
    return dataclasses.replace(options, pools=pools)
