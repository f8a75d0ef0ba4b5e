"""Choose a pool and a replica for one request. Pure policy: state in, decision out, no I/O.

Pool choice prefers the pools compiled for the request's shape and overflows to the least-loaded
other pool of the same model once those are saturated. Replica choice inside a pool is least
outstanding work, with prefix affinity: the request's prefix fingerprint ranks replicas by
rendezvous hashing and the top-ranked one is taken unless it carries more than ``affinity_slack``
times the pool's mean load (consistent hashing with bounded load), so prefix caches get hits
without hot-spotting.

When capacity is short, higher tiers go first: with ``tiers`` given, a request of a tier whose
priority is at least ``RouterSettings.shed_priority`` (``batch`` by default) is shed with 429 and
``Retry-After`` once every pool it could use is at ``shed_load_fraction`` or more, while higher
tiers are still placed (and fleet.queueing orders whoever waits). Shedding the loose tier before
the pools are full keeps the headroom interactive requests need to meet their TTFT.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from classifiers.shape import Shape
from fleet.pool import PoolState, ReplicaState
from fleet.tiers import TierSlo


@dataclass(frozen=True, slots=True)
class Route:
    pool: str
    replica: str
    url: str
    overflow: bool  # True when the shape's own pools were saturated or absent


@dataclass(frozen=True, slots=True)
class Reject:
    status: int
    code: str
    reason: str
    retry_after_s: float


@dataclass(frozen=True, slots=True)
class RouterSettings:
    affinity_slack: float = 1.5
    shed_priority: int = 2  # tiers at this priority or lower (a larger number) are shed first
    shed_load_fraction: float = 1.0
    shed_retry_after_s: float = 2.0


def route(
    shape: Shape,
    model: str,
    pools: Sequence[PoolState],
    now: float,
    settings: RouterSettings,
    exclude: Collection[str] = (),
    tiers: Mapping[str, TierSlo] | None = None,
) -> Route | Reject:
    """Pick where ``shape`` goes; ``exclude`` lists replica names already tried for this request;
    ``tiers`` (optional) enables shedding of the lowest tiers when every usable pool is loaded."""
    serving = [p for p in pools if p.serves(model)]
    if not serving:
        return Reject(404, "model_not_found", f"no pool serves model {model!r}", 0.0)
    own = [p for p in serving if shape.name in p.shapes]
    ordered = _by_load(own, now) + _by_load([p for p in serving if p not in own], now)
    saturated_own = [p for p in ordered[: len(own)] if p.load_fraction(now) >= 1.0]
    if own and len(saturated_own) == len(own):
        # Overflow only to a pool with room; if every pool is full, stay with the shape's own pools.
        with_room = [p for p in ordered[len(own):] if p.load_fraction(now) < 1.0]
        ordered = with_room + ordered[: len(own)] + [p for p in ordered[len(own):] if p not in with_room]
    if tiers is not None and _should_shed(shape, ordered, now, settings, tiers):
        return Reject(429, "shed", f"capacity is short; tier {shape.tier!r} is shed first", settings.shed_retry_after_s)
    for pool in ordered:
        replica = pick_replica(shape, model, pool.replicas, now, settings, exclude)
        if replica is not None:
            return Route(pool.name, replica.name, replica.url, overflow=pool not in own)
    return Reject(503, "no_healthy_replica", f"no healthy replica can serve model {model!r} right now", 1.0)


def _should_shed(shape: Shape, ordered: list[PoolState], now: float, settings: RouterSettings, tiers: Mapping[str, TierSlo]) -> bool:
    slo = tiers.get(shape.tier)
    if slo is None or slo.priority < settings.shed_priority:
        return False
    return all(p.load_fraction(now) >= settings.shed_load_fraction for p in ordered)


def _by_load(pools: list[PoolState], now: float) -> list[PoolState]:
    return sorted(pools, key=lambda p: p.load_fraction(now))


def pick_replica(
    shape: Shape,
    model: str,
    replicas: Sequence[ReplicaState],
    now: float,
    settings: RouterSettings,
    exclude: Collection[str] = (),
) -> ReplicaState | None:
    live = [r for r in replicas if not r.draining and r.name not in exclude and r.serves(model) and r.breaker.available(now)]
    if not live:
        return None
    if len(live) == 1:
        return live[0]
    if shape.prefix_fp:
        bound = settings.affinity_slack * (sum(r.num_in_flight for r in live) / len(live) + 1.0)
        ranked = sorted(live, key=lambda r: _mix64(shape.prefix_fp ^ r.affinity_salt), reverse=True)
        for replica in ranked:
            if replica.num_in_flight < bound:
                return replica
    return min(live, key=lambda r: (r.outstanding_tokens, r.num_in_flight))


def _mix64(value: int) -> int:
    """SplitMix64's finaliser: a well-spread, process-independent rank for rendezvous hashing."""
    z = (value + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return z ^ (z >> 31)
