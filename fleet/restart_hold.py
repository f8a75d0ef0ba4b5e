"""Where a request waits while every replica of its model is out of service for a restart: no blackout during a move.

When the controller or an operator move (``POST /admin/move``) drains and restarts the last replica
serving a model (a recompile in place, or a move into another pool of the model), the router finds
no routable replica and would answer 503 for the whole restart. ``hold_pool`` says instead which
pool's hold queue the request waits in: one a replica of the model is coming back to (draining
before its restart, or started and not yet healthy), so the request is served when that replica
is routed again, or answered 503 with ``Retry-After`` when its hold deadline passes first. A model
that some pool still serves with a routable replica is routed as before (another pool of the model
takes it), and one with no replica coming back gets its 503 at once.

Pure: the caller passes the pools and the restarts it knows of.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from fleet.pool import PoolState


@dataclass(frozen=True, slots=True)
class Restart:
    """A launched replica out of service for a move that brings it back: into ``pool``, serving ``model``."""

    slot: str
    pool: str
    model: str


def hold_pool(model: str, pools: Sequence[PoolState], restarts: Sequence[Restart], now: float) -> str | None:
    """The pool whose hold queue a request for ``model`` waits in; None: route it as it is (a pool
    serving ``model`` has a routable replica, or no replica of ``model`` is coming back)."""
    if any(p.serves(model) and p.num_routable(now) > 0 for p in pools):
        return None
    return next((r.pool for r in restarts if r.model == model), None)
