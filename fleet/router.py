"""Choose a pool and a replica for one request. Pure policy: state in, decision out, no I/O.

``route`` runs the steps ``RouterSettings`` names (both in fleet.router_steps, where each step is described):
pool filter (which pools serve the model) -> pool scorer (rank them; skipped when one is left, as for
a model served by one pool) -> admission (with ``tiers``: run now, ``Wait`` in the best pool's queue,
or 429 ``shed``) -> in each ranked pool, replica filter (serves the model, routable, not tried yet)
and replica picker (``pick_replica``); the first pool with a replica left wins, and ``Route`` names
it, or 503 when none has one. The settings compose their ``Router`` once, when they are built (config
load), so the gateway (gateway/proxy.py, gateway/pool_wait.py), the dispatcher (fleet/dispatch.py)
and the simulator (fleet/simulator/world.py), given the same settings, route identically.

The defaults are the router as it was before the steps had names. Pools are scored by the
predicted chance that the request meets its tier's TTFT objective there (``slo_chance``, a closed
form: no per-request simulation, O(pools + replicas) arithmetic): pools with a chance of at least
``good_chance`` come first, the shape's own pools (compiled for it) by load, then other pools by
cost per request; below that, pools by chance. When capacity is short, higher tiers go first: the
best pool, saturated, parks the request in its queue by priority and deadline, or sheds it at once
when the chance is below ``shed_chance``; without a queue, tiers at or below ``shed_priority`` are
shed once every usable pool is ``shed_load_fraction`` loaded. Inside a pool, prefix affinity by
rendezvous hashing with bounded load (``affinity_slack``), else least outstanding work.

A replica's load is the gateway's own work in flight plus its ``foreign_requests``: what its engine
reported running and waiting at the last scrape of its ``/metrics`` beyond what this gateway had in
flight there (another gateway or a client sharing the engine), so requests we sent are never counted
twice; without engine figures it is 0 and the gateway's own counts decide. Pool scores count it too
(``ReplicaState.work_in_flight``).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from classifiers.shape import Shape
from fleet.engines.load import EngineLoad
from fleet.pool import PoolState, ReplicaState
from fleet.router_decisions import Reject, Route, Wait
from fleet.router_steps import RouterSettings, poisson_at_least, request_slots, slo_chance, work_units
from kernels.tiers import DEFAULT_TIERS, TierSlo, slo_for

# Route, Wait, Reject and the closed forms are used through this module by the gateway, the simulator and the tests.
__all__ = [
    "Reject", "Route", "RouterSettings", "Wait", "foreign_requests", "pick_replica", "poisson_at_least", "request_slots", "route", "slo_chance",
    "work_units",
]


def route(
    shape: Shape,
    model: str,
    pools: Sequence[PoolState],
    now: float,
    settings: RouterSettings,
    exclude: Collection[str] = (),
    tiers: Mapping[str, TierSlo] | None = None,
) -> Route | Wait | Reject:
    """Pick where ``shape`` goes; ``exclude`` lists replica names already tried for this request;
    ``tiers`` (optional) enables waiting in pool queues and shedding when capacity is short."""
    steps = settings.steps
    serving = steps.pool_filter(pools, shape, model)
    if not serving:
        return Reject(404, "model_not_found", f"no pool serves model {model!r}", 0.0)
    slo = slo_for(tiers or DEFAULT_TIERS, shape.tier)
    wait_s = settings.wait_share * slo.ttft_p99_s
    # work_units is computed once per pool: for the ranking, the admission and the route's books
    if len(serving) == 1:  # nothing to rank (one pool per model is common): spare the hot path the scoring
        ranked = [(serving[0], work_units(shape, serving[0]))]
    else:
        works = [work_units(shape, p) for p in serving]
        has_own = any(shape.name in p.shapes for p in serving)
        score = steps.pool_scorer
        scored = [(score(p, shape, now, slo, wait_s, settings, has_own, works[i]), i, p) for i, p in enumerate(serving)]
        scored.sort()  # in place: a list comprehension is cheaper to fill than a generator is to drain into sorted()
        ranked = [(p, works[i]) for _, i, p in scored]
    if tiers is not None:
        held = steps.admission(shape, ranked, now, slo, wait_s, settings, tiers)
        if held is not None:
            return held
    for pool, work in ranked:
        replica = pick_replica(shape, model, pool.replicas, now, settings, exclude)
        if replica is not None:
            return Route(pool.name, replica.name, replica.url, overflow=shape.name not in pool.shapes, work=work)
    return Reject(503, "no_healthy_replica", f"no healthy replica can serve model {model!r} right now", 1.0)


def pick_replica(
    shape: Shape,
    model: str,
    replicas: Sequence[ReplicaState],
    now: float,
    settings: RouterSettings,
    exclude: Collection[str] = (),
) -> ReplicaState | None:
    """The settings' replica filter, then (among two or more) their replica picker; None: none passed."""
    steps = settings.steps
    live = steps.replica_filter(replicas, model, now, exclude)
    if not live:
        return None
    if len(live) == 1:
        return live[0]
    return steps.replica_picker(shape, live, settings)


def foreign_requests(engine: EngineLoad, own_in_flight: int) -> int:
    """Requests an engine reports (running and waiting) beyond the ``own_in_flight`` this gateway has
    there as the report arrives: the load someone else put on it. Stored on the replica at each
    scrape, so own requests sent after it count once, through the gateway's own books."""
    return max(0, engine.num_requests - own_in_flight)
