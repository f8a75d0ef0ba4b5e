"""Choose a pool and a replica for one request. Pure policy: state in, decision out, no I/O.

``route`` runs the steps ``RouterSettings`` names (fleet.router_steps, where each is described):
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
from dataclasses import dataclass, field

from classifiers.shape import Shape
from fleet.engines.load import EngineLoad
from fleet.pool import PoolState, ReplicaState
from fleet.router_decisions import Reject, Route, Wait
from fleet.router_steps import Router, compose, poisson_at_least, request_slots, slo_chance, work_units
from kernels.tiers import DEFAULT_TIERS, TierSlo, slo_for

# Route, Wait, Reject and the closed forms are used through this module by the gateway, the simulator and the tests.
__all__ = [
    "Reject", "Route", "RouterSettings", "Wait", "foreign_requests", "pick_replica", "poisson_at_least", "request_slots", "route", "slo_chance",
    "work_units",
]


@dataclass(frozen=True, slots=True)
class RouterSettings:
    affinity_slack: float = 1.5
    shed_priority: int = 2  # tiers at this priority or lower (a larger number) are shed first
    shed_load_fraction: float = 1.0
    shed_retry_after_s: float = 2.0  # the least Retry-After a shed answer carries
    good_chance: float = 0.9  # a pool at least this likely to meet the SLO is good enough: own shape, then cost
    shed_chance: float = 0.05  # below this, a request is shed at once instead of waiting in a queue
    wait_share: float = 0.5  # share of the tier's TTFT objective a request may spend waiting for a replica
    # Share of each replica's running slots (``max_running_per_replica``) that tiers at or below
    # ``shed_priority`` may not take, in pools that keep a queue: a batch flood then leaves room in the
    # engine's batch, and a more urgent request starts at its next step instead of waiting for a batch
    # request to finish (an engine's priority scheduler orders its waiting queue but does not preempt a
    # full batch for a newcomer). 0 (default): batch may fill the slots; its throughput then pays nothing
    # when no urgent traffic comes. See `polymorph bench priority` for the measured trade-off.
    urgent_reserve: float = 0.0
    # How far back the gateway looks for the most urgent requests a pool had in flight at once: with
    # ``urgent_reserve`` > 0 each replica keeps that many slots (spread over its replicas), plus one,
    # from batch when that is more than the share (fleet.urgent_demand). 0: measure nothing (the share alone).
    urgent_window_s: float = 30.0
    # Share of a modelled pool's running slots another shape's request (an overflow) may count on; the
    # rest stays for the pool's own shape, whose next requests would otherwise find it full of heavier
    # overflow and be shed (fleet.router_steps.request_slots). 1: overflow may fill the pool.
    overflow_share: float = 0.5
    # The steps, by name (fleet.router_steps.STEPS lists each stage's; these are the defaults).
    pool_filter: str = "serves_model"
    pool_scorer: str = "slo_chance"
    admission: str = "queue_or_shed"
    replica_filter: str = "untried_routable"
    replica_picker: str = "prefix_affinity"
    steps: Router = field(init=False, repr=False, compare=False)  # the named steps, composed once

    def __post_init__(self) -> None:
        if not 0.0 < self.overflow_share <= 1.0:
            raise ValueError(f"overflow_share must be in (0, 1], got {self.overflow_share}")
        object.__setattr__(self, "steps", compose(self))  # frozen: set once here, only read per request


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
