"""Live pools and replicas as the gateway sees them: where they are and how loaded they are.

These are the mutable facts the router reads; the router itself never changes them. The gateway's
event loop is their only writer (one thread), so no locks are needed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fleet.health import CircuitBreaker


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
    draining: bool = False
    offers_health: bool = True  # False once /health answered 404: active probes skip it

    def serves(self, model: str) -> bool:
        return self.models is None or model in self.models

    def begin(self, tokens: int) -> None:
        self.num_in_flight += 1
        self.outstanding_tokens += tokens

    def end(self, tokens: int) -> None:
        self.num_in_flight -= 1
        self.outstanding_tokens -= tokens


@dataclass(slots=True, eq=False)
class PoolState:
    name: str
    models: frozenset[str] | None  # None: any model its replicas report
    shapes: frozenset[str]
    gpu: str | None
    max_running_per_replica: int
    replicas: list[ReplicaState] = field(default_factory=list)

    def serves(self, model: str) -> bool:
        if self.models is not None:
            return model in self.models
        return any(r.serves(model) for r in self.replicas)

    @property
    def num_in_flight(self) -> int:
        return sum(r.num_in_flight for r in self.replicas)

    def load_fraction(self, now: float) -> float:
        """In-flight requests over what the available replicas run at once (inf when none is available)."""
        capacity = sum(self.max_running_per_replica for r in self.replicas if not r.draining and r.breaker.available(now))
        return self.num_in_flight / capacity if capacity else float("inf")
