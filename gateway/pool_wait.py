"""Requests parked in their pool's queue until a replica has room: the gateway's side of the router's ``Wait``.

The policy is the router's and ``fleet.queueing.PoolQueue``'s, as the simulator runs it
(fleet/simulator/world.py): when the best pool is saturated the router answers ``Wait`` and the
request is offered to that pool's bounded queue by tier priority and deadline (a full queue sheds
its least urgent entry, possibly the newcomer). It is admitted, most urgent first, when a routable
replica of the pool carries less than ``max_running_per_replica`` work: when a request on the pool
ends, when the pools change (a replica added, a plan's larger concurrency, a reload) and on a short
tick (a replica whose circuit breaker lets it back in). The pump (fleet.dispatch, the simulator's
too) picks the replica and this module holds the slot for the waiter, so nothing that arrives
meanwhile takes it. A request still waiting at its deadline (the router's wait budget, a share of its tier's TTFT
objective, in fleet time) is shed with 429 and ``Retry-After``; a client that goes away leaves the
queue at once; a pool left with no routable replica hands its waiters back to be routed again.
Everything runs on the event loop, the pools' only writer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

from classifiers.shape import Shape
from fleet.dispatch import Queued, pump
from fleet.pool import PoolState, ReplicaState
from fleet.queueing import PoolQueue, Shed
from fleet.router import Route, RouterSettings, Wait, work_units
from fleet.urgent_demand import UrgentDemand
from gateway.errors import ApiError
from gateway.metrics import GatewayMetrics
from gateway.runtime import Runtime

# How often queues are re-checked while anyone waits: a replica ejected by its circuit breaker comes
# back when its cool-down passes, which no request's end announces.
TICK_S = 0.25


@dataclass(slots=True, eq=False)
class _Waiter:
    future: asyncio.Future[ReplicaState | None]  # the replica whose slot it was given, or None: route it again
    shape: Shape
    model: str
    tried: tuple[str, ...]
    tokens: int
    work: float  # fleet.router.work_units in its pool: the slot it holds, as the proxy's own begin() counts it
    pool: str
    parked_at: float
    timer: asyncio.TimerHandle | None = None
    settled: bool = False  # out of the queue's books (given a slot, shed, routed again or gone)


def _describe(waiter: _Waiter) -> Queued:
    return Queued(waiter.shape, waiter.model, waiter.tried)


class PoolWaits:
    """Every pool's queue of waiting requests, carried over by pool name when the pools are swapped."""

    def __init__(self, metrics: GatewayMetrics, settings: RouterSettings) -> None:
        self.metrics = metrics
        self.settings = settings
        self.runtime: Runtime | None = None  # the current one, as last attached
        self.num_waiting = 0
        self._queues: dict[str, PoolQueue[_Waiter]] = {}
        self._pools: dict[str, PoolState] = {}
        self._demands: dict[str, UrgentDemand] = {}  # by pool name, like the queues: in-flight counts outlive a swap
        self._tick: asyncio.TimerHandle | None = None

    def attach(self, runtime: Runtime, now: float) -> None:
        """Give each pool of ``runtime`` (now current) its bounded queue and admit whoever now has room.

        Only pools with a known saturation point queue: a plan's capacity model (the concurrency it
        sized to meet the SLO) or the operator's ``max_in_flight_per_replica``. Otherwise a pool's
        ``max_running_per_replica`` is the engine's batch limit, behind which the engine queues on its
        own, so it is routed as before. ``upstream.queue_max_len: 0`` turns queues off (the router
        then never answers ``Wait``); requests already waiting are still admitted or shed."""
        self.runtime = runtime
        self.settings = runtime.config.router
        self._pools = {pool.name: pool for pool in runtime.pools}
        max_len = runtime.config.upstream.queue_max_len
        for pool in runtime.pools:
            if not (max_len > 0 and pool.knows_capacity):
                pool.queue = None
                continue
            queue = self._queues.get(pool.name)
            if queue is None:
                queue = self._queues[pool.name] = PoolQueue(max_len, self.settings.shed_retry_after_s)
            queue.max_len = max_len
            pool.queue = queue
            pool.urgent_demand = None
            if self.settings.urgent_reserve > 0 and self.settings.urgent_window_s > 0:  # the reserve covers the urgent requests measured in flight together
                demand = self._demands.get(pool.name)
                if demand is None:
                    demand = self._demands[pool.name] = UrgentDemand(self.settings.urgent_window_s)
                demand.window_s = self.settings.urgent_window_s
                pool.urgent_demand = demand
        self.pump_all(now)

    async def wait(
        self, decision: Wait, shape: Shape, model: str, tried: Sequence[str], tokens: int
    ) -> tuple[Route, ReplicaState] | None:
        """Park the request until a replica of ``decision.pool`` takes it: that route (with the
        request's work units there) and replica (its slot free for the caller to take), or None to
        route it again (its pool has no routable replica now). Raises the 429 when it is shed."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        pool, queue = self._pools.get(decision.pool), self._queues.get(decision.pool)
        if pool is None or queue is None or self.runtime is None or pool.num_routable(now) == 0:
            return None  # decided on pools that have since been swapped
        waiter = _Waiter(loop.create_future(), shape, model, tuple(tried), tokens, work_units(shape, pool), decision.pool, now)
        # the router's deadline is in fleet time; emulated replicas may run faster than the wall clock
        deadline_at = now + (decision.deadline_at - now) / self.runtime.time_scale(decision.pool)
        shed = queue.offer(waiter, decision.priority, deadline_at)
        if shed is not None and shed.item is waiter:
            self._count_shed(waiter, "full")
            raise self._shed_error(waiter, shed)
        self.num_waiting += 1
        self.metrics.child(self.metrics.queue_depth, waiter.pool, shape.tier).inc()
        self.metrics.child(self.metrics.queue_waits, waiter.pool, shape.tier).inc()
        if shed is not None:
            self._shed(shed)
        waiter.timer = loop.call_at(deadline_at, self._expire, waiter)
        if self._tick is None:
            self._tick = loop.call_later(TICK_S, self._on_tick)
        try:
            replica = await waiter.future
        except asyncio.CancelledError:  # the client went away
            self._leave(waiter)
            raise
        if replica is None:
            return None
        replica.end(tokens, waiter.work)  # the slot held since the pump chose this replica passes to the caller's own begin()
        return Route(decision.pool, replica.name, replica.url, decision.overflow, waiter.work), replica

    def wake(self, pool_name: str, now: float) -> None:
        """A request on ``pool_name`` ended: admit its queue's most urgent waiters while there is room."""
        pool, queue = self._pools.get(pool_name), self._queues.get(pool_name)
        if pool is not None and queue is not None and len(queue):
            self._pump(pool, queue, now)

    def pump_all(self, now: float) -> None:
        """Admit waiters wherever there is room; a pool with no routable replica (or no longer one of the
        pools) hands its waiters back to be routed again, as the simulator's tick does."""
        for name, queue in list(self._queues.items()):
            pool = self._pools.get(name)
            if pool is None and not len(queue):
                del self._queues[name]
            elif pool is None or pool.num_routable(now) == 0:
                while len(queue):
                    waiter, expired = queue.take(now)
                    self._shed_all(expired)
                    if waiter is not None:
                        self._admit(waiter, None)
            else:
                self._pump(pool, queue, now)

    def _pump(self, pool: PoolState, queue: PoolQueue[_Waiter], now: float) -> None:
        pump(pool, queue, now, self.settings, _describe, lambda waiter, replica: self._take(waiter, replica, now), self._shed_all)

    def _take(self, waiter: _Waiter, replica: ReplicaState | None, now: float) -> None:
        """The dispatcher placed ``waiter`` (None: route it again): hold the slot for it until it takes it."""
        if replica is not None and not waiter.future.done():
            replica.begin(waiter.tokens, waiter.work)
            self.metrics.child(self.metrics.queue_wait, waiter.pool, waiter.shape.tier).observe(now - waiter.parked_at)
        self._admit(waiter, replica)

    def _admit(self, waiter: _Waiter, replica: ReplicaState | None) -> None:
        """Out of the queue with a held slot on ``replica``, or None: to be routed again."""
        if self._settle(waiter) and not waiter.future.done():
            waiter.future.set_result(replica)

    def _expire(self, waiter: _Waiter) -> None:
        queue = self._queues.get(waiter.pool)
        if queue is not None and queue.remove(waiter):
            self._shed(Shed(waiter, "deadline passed", queue.retry_after_s))

    def _shed_all(self, shed: list[Shed[_Waiter]]) -> None:
        for item in shed:
            self._shed(item)

    def _shed(self, shed: Shed[_Waiter]) -> None:
        waiter = shed.item
        if not self._settle(waiter):
            return
        self._count_shed(waiter, "deadline" if shed.reason == "deadline passed" else "full")
        if not waiter.future.done():
            waiter.future.set_exception(self._shed_error(waiter, shed))

    def _leave(self, waiter: _Waiter) -> None:
        """The client went away: out of the queue at once, or the slot it was given goes to the next."""
        if self._settle(waiter):
            queue = self._queues.get(waiter.pool)
            if queue is not None:
                queue.remove(waiter)
            return
        if waiter.future.done() and not waiter.future.cancelled() and waiter.future.exception() is None:
            replica = waiter.future.result()
            if replica is not None:
                replica.end(waiter.tokens, waiter.work)
                self.wake(waiter.pool, asyncio.get_running_loop().time())

    def _settle(self, waiter: _Waiter) -> bool:
        """Take ``waiter`` off the books (the caller has taken it out of its queue); False if it already was."""
        if waiter.settled:
            return False
        waiter.settled = True
        if waiter.timer is not None:
            waiter.timer.cancel()
        self.num_waiting -= 1
        self.metrics.child(self.metrics.queue_depth, waiter.pool, waiter.shape.tier).dec()
        return True

    def _on_tick(self) -> None:
        loop = asyncio.get_running_loop()
        self._tick = None
        self.pump_all(loop.time())
        if self.num_waiting:
            self._tick = loop.call_later(TICK_S, self._on_tick)

    def _count_shed(self, waiter: _Waiter, reason: str) -> None:
        self.metrics.child(self.metrics.queue_sheds, waiter.pool, waiter.shape.tier, reason).inc()

    @staticmethod
    def _shed_error(waiter: _Waiter, shed: Shed[_Waiter]) -> ApiError:
        tier, pool = waiter.shape.tier, waiter.pool
        if shed.reason == "deadline passed":
            reason = f"capacity is short; a tier {tier!r} request waited for pool {pool!r} until its deadline passed"
        else:
            reason = f"capacity is short; pool {pool!r}'s queue is full and tier {tier!r} is shed first"
        return ApiError(429, reason, "shed", retry_after_s=shed.retry_after_s)
