"""What the router answers for one request: a replica to send it to, a pool queue to wait in, or a refusal."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Route:
    pool: str
    replica: str
    url: str
    overflow: bool  # True when the shape's own pools were saturated or absent
    work: float = 1.0  # work_units(shape, pool): what the request weighs in its replica's books (begin/end)


@dataclass(frozen=True, slots=True)
class Wait:
    """Park the request in ``pool``'s queue until a replica has room, or shed it at ``deadline_at``."""

    pool: str
    priority: int
    deadline_at: float
    slo_chance: float
    overflow: bool


@dataclass(frozen=True, slots=True)
class Reject:
    status: int
    code: str
    reason: str
    retry_after_s: float
