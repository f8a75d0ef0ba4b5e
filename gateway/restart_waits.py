"""Requests held while every replica of their model restarts: the gateway's side of ``fleet.restart_hold``.

The proxy asks ``hold`` when the router finds no routable replica for a request's model. If a replica
of the model is coming back (``fleet.restart_hold.hold_pool``: draining before its restart, or started
and not yet healthy), the request waits in that pool's hold queue (a ``fleet.queueing.PoolQueue``:
most urgent tier first, bounded by ``upstream.queue_max_len``) and is routed again, most urgent first,
as soon as a replica serves the model again (the pools are swapped when the restarted replica is
routed) or the restart ends without one (its start failed for good: the router's 503 then stands).
A request still held after ``upstream.restart_hold_s`` (or its tier's ``deadline_s``, if shorter) is
answered 503 ``replica_restarting`` with ``Retry-After``; a client that goes away leaves at once.
The restarts come from the control loop that moves replicas (``gateway.live_fleet.LiveFleet``, which
calls ``connect``); without one nothing is ever held. Everything runs on the event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from fleet.pool import PoolState
from fleet.queueing import PoolQueue, Shed
from fleet.restart_hold import Restart, hold_pool
from gateway.config import GatewayConfig
from gateway.errors import ApiError
from gateway.metrics import GatewayMetrics
from kernels.tiers import TierSlo

# How often held requests are re-checked: a start that fails for good announces nothing, and its
# requests should get their 503 then, not at their deadline.
TICK_S = 0.25


@dataclass(slots=True, eq=False)
class _Held:
    future: asyncio.Future[None]
    model: str
    pool: str
    tier: str
    timer: asyncio.TimerHandle | None = None
    settled: bool = False


class RestartHolds:
    """Every (pool, model)'s hold queue while a replica restarts."""

    def __init__(self, metrics: GatewayMetrics) -> None:
        self.metrics = metrics
        self.num_held = 0
        self._restarts: Callable[[], Sequence[Restart]] = tuple
        self._pools: Callable[[], Sequence[PoolState]] = tuple
        self._queues: dict[tuple[str, str], PoolQueue[_Held]] = {}
        self._tick: asyncio.TimerHandle | None = None

    def connect(self, restarts: Callable[[], Sequence[Restart]], pools: Callable[[], Sequence[PoolState]]) -> None:
        """Read the replicas coming back and the current pools from the control loop that moves them."""
        self._restarts, self._pools = restarts, pools

    async def hold(self, model: str, tier: str, slo: TierSlo | None, config: GatewayConfig) -> bool:
        """Wait while ``model``'s replicas restart; True: route it again now. False: nothing restarts for
        it (or holding is off), so the router's answer stands. Raises the 503 when the hold deadline
        (``upstream.restart_hold_s``, or the tier's ``deadline_s`` if shorter) passes first, or when the
        hold queue is full of more urgent requests."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        upstream = config.upstream
        hold_s, max_len = min(upstream.restart_hold_s, slo.deadline_s if slo is not None else upstream.restart_hold_s), upstream.queue_max_len
        priority, retry_after_s = slo.priority if slo is not None else 0, config.router.shed_retry_after_s
        pool = hold_pool(model, self._pools(), self._restarts(), now) if hold_s > 0 and max_len > 0 else None
        if pool is None:
            return False
        queue = self._queues.get((pool, model))
        if queue is None:
            queue = self._queues[(pool, model)] = PoolQueue(max_len, retry_after_s)
        held = _Held(loop.create_future(), model, pool, tier)
        shed = queue.offer(held, priority, now + hold_s)
        if shed is not None and shed.item is held:
            self._count(held, "full")
            raise _error(held, shed)
        self.num_held += 1
        self.metrics.child(self.metrics.restart_held, pool, tier).inc()
        if shed is not None:
            self._shed(shed)
        held.timer = loop.call_at(now + hold_s, self._expire, held, queue)
        if self._tick is None:
            self._tick = loop.call_later(TICK_S, self._on_tick)
        try:
            await held.future
        except asyncio.CancelledError:  # the client went away
            if self._settle(held):
                queue.remove(held)
                self._count(held, "gone")
            raise
        return True

    def wake(self, now: float) -> None:
        """The pools changed (a replica routed again, one stopped): release whoever may be routed now."""
        if not self.num_held:
            return
        pools, restarts = self._pools(), self._restarts()
        for (pool, model), queue in list(self._queues.items()):
            if hold_pool(model, pools, restarts, now) == pool:
                continue
            while len(queue):  # most urgent first, so they reach the router (and its pool queues) in that order
                held, expired = queue.take(now)
                for item in expired:
                    self._shed(item)
                if held is not None and self._settle(held):
                    self._count(held, "released")
                    held.future.set_result(None)
            del self._queues[(pool, model)]

    def _on_tick(self) -> None:
        loop = asyncio.get_running_loop()
        self._tick = None
        self.wake(loop.time())
        if self.num_held:
            self._tick = loop.call_later(TICK_S, self._on_tick)

    def _expire(self, held: _Held, queue: PoolQueue[_Held]) -> None:
        if queue.remove(held):
            self._shed(Shed(held, "deadline passed", queue.retry_after_s))

    def _shed(self, shed: Shed[_Held]) -> None:
        held = shed.item
        if not self._settle(held):
            return
        self._count(held, "deadline" if shed.reason == "deadline passed" else "full")
        if not held.future.done():
            held.future.set_exception(_error(held, shed))

    def _settle(self, held: _Held) -> bool:
        """Take ``held`` off the books (the caller took it out of its queue); False if it already was."""
        if held.settled:
            return False
        held.settled = True
        if held.timer is not None:
            held.timer.cancel()
        self.num_held -= 1
        self.metrics.child(self.metrics.restart_held, held.pool, held.tier).dec()
        return True

    def _count(self, held: _Held, outcome: str) -> None:
        self.metrics.child(self.metrics.restart_holds, held.pool, held.tier, outcome).inc()


def _error(held: _Held, shed: Shed[_Held]) -> ApiError:
    if shed.reason == "deadline passed":
        reason = f"every replica serving model {held.model!r} is restarting (pool {held.pool!r}); it was not back in time"
    else:
        reason = f"every replica serving model {held.model!r} is restarting (pool {held.pool!r}) and its hold queue is full"
    return ApiError(503, reason, "replica_restarting", retry_after_s=shed.retry_after_s)
