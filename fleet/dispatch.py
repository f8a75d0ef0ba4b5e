"""One dispatcher for both clocks: admit a pool's queued requests while its replicas have room.

The gateway (gateway/pool_wait.py, on its event loop) and the simulator (fleet/simulator/world.py, in
virtual time) both run ``pump``: most urgent first, while a routable replica of the pool carries less
work than the waiter's tier may hold there (``max_running_per_replica``, less ``urgent_reserve`` for
batch: fleet.router_steps.slots_per_replica), the next waiter is taken from the queue (those whose deadline
passed meanwhile are shed) and placed on a replica by the router's ``pick_replica`` (the replica filter
and picker ``settings`` composed: the steps ``route`` uses), avoiding replicas that already failed it
while another has room. Placing it is the caller's ``admit``, called at once:
it takes the slot (``ReplicaState.begin``), so the next pick sees it taken.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import TypeVar

from classifiers.shape import Shape
from fleet.pool import PoolState, ReplicaState
from fleet.queueing import PoolQueue, Shed
from fleet.router import RouterSettings, pick_replica
from fleet.router_steps import slots_per_replica

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Queued:
    """What the dispatcher needs of a waiting request to place it."""

    shape: Shape
    model: str
    tried: Collection[str] = ()  # replicas that already failed it


def pump(
    pool: PoolState,
    queue: PoolQueue[T],
    now: float,
    settings: RouterSettings,
    describe: Callable[[T], Queued],
    admit: Callable[[T, ReplicaState | None], None],
    shed: Callable[[list[Shed[T]]], None],
) -> None:
    """Admit ``queue``'s waiters onto ``pool``'s replicas with room; ``admit(item, None)``: no replica
    with room serves its model (route it again)."""
    while len(queue):
        head = queue.head_priority()  # the room a waiter may take depends on its tier (RouterSettings.urgent_reserve)
        room = pool.replicas_with_room(now, slots_per_replica(pool, head, settings, now) if head is not None else None)
        if not room:
            return
        item, expired = queue.take(now)
        if expired:
            shed(expired)
        if item is None:
            return
        wanted = describe(item)
        replica = pick_replica(wanted.shape, wanted.model, room, now, settings, wanted.tried) if wanted.tried else None
        admit(item, replica or pick_replica(wanted.shape, wanted.model, room, now, settings))
