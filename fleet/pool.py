"""Live pools and replicas as the gateway sees them: where they are and how loaded they are.

These are the mutable facts the router reads; the router itself never changes them. The gateway's
event loop is their only writer (one thread), so no locks are needed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fleet.engine_share import ShareClock
from fleet.engines.load import EngineLoad
from fleet.health import CircuitBreaker
from fleet.queueing import PoolQueue
from fleet.urgent_demand import UrgentDemand


@dataclass(slots=True, eq=False)
class ReplicaState:
    name: str
    url: str
    pool: str
    breaker: CircuitBreaker
    models: frozenset[str] | None = None  # None: serves whatever its pool serves
    affinity_salt: int = 0
    num_in_flight: int = 0
    outstanding_tokens: int = 0  # predicted prompt + output tokens of the requests in flight
    extra_work: float = 0.0  # in-flight work beyond one unit per request (fleet.router.work_units)
    draining: bool = False
    offers_health: bool = True  # False once /health answered 404: active probes skip it
    engine: EngineLoad | None = None  # the engine's own figures from its /metrics (None: not read, or unreadable)
    # Requests the engine held at that scrape beyond this gateway's own in flight there (another
    # gateway's or a direct client's): counted as load until the next scrape. 0 without engine figures.
    foreign_requests: int = 0
    share: ShareClock = field(default_factory=ShareClock)  # splits its engine time among the requests in flight (cost per tenant)

    def serves(self, model: str) -> bool:
        return self.models is None or model in self.models

    def routable(self, now: float) -> bool:
        """May new requests go here: not draining, and its circuit breaker lets traffic through."""
        return not self.draining and self.breaker.available(now)

    def begin(self, tokens: int, work: float = 1.0) -> None:
        self.num_in_flight += 1
        self.outstanding_tokens += tokens
        self.extra_work += work - 1.0

    def end(self, tokens: int, work: float = 1.0) -> None:
        self.num_in_flight -= 1
        self.outstanding_tokens -= tokens
        self.extra_work -= work - 1.0

    @property
    def work_in_flight(self) -> float:
        """The requests in flight in units of its pool's own requests (each counts 1 unless weighed),
        the engine's foreign requests included."""
        return self.num_in_flight + self.extra_work + self.foreign_requests


@dataclass(slots=True, eq=False)
class PoolState:
    name: str
    models: frozenset[str] | None  # None: any model its replicas report
    shapes: frozenset[str]
    gpu: str | None
    max_running_per_replica: int  # in flight per replica at which the pool counts as saturated
    replicas: list[ReplicaState] = field(default_factory=list)
    # From the capacity model (0: unknown): requests/s one replica serves within its shape's SLO, what
    # one replica's GPUs cost per hour, and its shape's mean lengths (to weigh other shapes' requests).
    # The router's SLO-chance and cost scores read them.
    rate_per_replica_rps: float = 0.0
    cost_per_hour: float = 0.0
    mean_prompt_tokens: float = 0.0
    mean_output_tokens: float = 0.0
    tpot_objective_s: float = 0.0  # the TPOT its concurrency was sized to meet (0: unknown)
    # Requests waiting for room in this pool, by tier priority and deadline; None: the caller keeps no
    # queue and the router never answers Wait for this pool.
    queue: PoolQueue[Any] | None = None
    # True when the operator set ``max_running_per_replica`` as the gateway's admission limit (config
    # ``max_in_flight_per_replica``), so requests beyond it wait in the queue as for a modelled pool.
    declared_limit: bool = False
    engine_kind: str = "emulated"  # fleet.engines.load.ENGINE_KINDS: how the pool's replicas read /metrics and take priorities
    priority_scheduling: bool = False  # its engines schedule by each request's ``priority`` (set from the tier)
    # Urgent requests in flight and their recent peak, as the gateway measures them (fleet.urgent_demand):
    # the running slots ``urgent_reserve`` keeps from batch cover them. None: the reserve is its share alone.
    urgent_demand: UrgentDemand | None = None

    def serves(self, model: str) -> bool:
        if self.models is not None:
            return model in self.models
        return any(r.serves(model) for r in self.replicas)

    @property
    def num_in_flight(self) -> int:
        return sum(r.num_in_flight for r in self.replicas)

    @property
    def work_in_flight(self) -> float:
        """The replicas' work in flight, in units of this pool's own requests."""
        return sum(r.work_in_flight for r in self.replicas)

    def num_routable(self, now: float) -> int:
        return sum(1 for r in self.replicas if r.routable(now))

    @property
    def knows_capacity(self) -> bool:
        """``max_running_per_replica`` is a real saturation point (a capacity model's SLO concurrency
        or the operator's declared limit), not just the engines' batch cap."""
        return self.rate_per_replica_rps > 0 or self.declared_limit

    def replicas_with_room(self, now: float, per_replica: float | None = None) -> list[ReplicaState]:
        """Routable replicas carrying less than ``per_replica`` work (default ``max_running_per_replica``):
        where a queued request may start."""
        limit = self.max_running_per_replica if per_replica is None else per_replica
        return [r for r in self.replicas if r.routable(now) and r.work_in_flight < limit]

    def load_fraction(self, now: float) -> float:
        """Work in flight over what the available replicas run at once (inf when none is available)."""
        capacity = self.num_routable(now) * self.max_running_per_replica
        return self.work_in_flight / capacity if capacity else float("inf")

    def cost_per_request(self) -> float:
        """GPU cost of one request served at capacity (0 when rate or price is unknown)."""
        return self.cost_per_hour / (3600.0 * self.rate_per_replica_rps) if self.rate_per_replica_rps > 0 else 0.0
