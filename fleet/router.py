"""Choose a pool and a replica for one request. Pure policy: state in, decision out, no I/O.

Pool choice prefers the pools compiled for the request's shape and overflows to the least-loaded
other pool of the same model once those are saturated. Replica choice inside a pool is least
outstanding work, with prefix affinity: the request's prefix fingerprint ranks replicas by
rendezvous hashing and the top-ranked one is taken unless it carries more than ``affinity_slack``
times the pool's mean load (consistent hashing with bounded load), so prefix caches get hits
without hot-spotting.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from classifiers.shape import Shape
from fleet.pool import PoolState, ReplicaState


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


def route(
    shape: Shape,
    model: str,
    pools: Sequence[PoolState],
    now: float,
    settings: RouterSettings,
    exclude: Collection[str] = (),
) -> Route | Reject:
    """Pick where ``shape`` goes; ``exclude`` lists replica names already tried for this request."""
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
    for pool in ordered:
        replica = pick_replica(shape, model, pool.replicas, now, settings, exclude)
        if replica is not None:
            return Route(pool.name, replica.name, replica.url, overflow=pool not in own)
    return Reject(503, "no_healthy_replica", f"no healthy replica can serve model {model!r} right now", 1.0)


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
