"""The control loop, live: the fleet controller ticking inside the gateway over emulated replicas.

The controller and its policy objects are the ones the simulator runs (fleet/controller.py); this
module is only their I/O edge. Process control is the ``ReplicaControl``'s that ``fleet.actuator``
chose (gateway.replicas: local processes or Ray actors), which is the controller's ``Actuator``;
``LiveFleet`` is its ``Routing``, the owner of the gateway's pools: drain marks a replica unroutable,
remove takes it out of its pool, add puts a started replica into its (possibly new) pool. Those
calls come from the controller's or the actuator's threads; their effects are handed to the event
loop, the pools' only writer. A tick runs in a worker thread, because a re-plan consults the
performance model for seconds.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
import zlib
from collections.abc import Callable, Mapping
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from typing import TYPE_CHECKING

import orjson

from fleet.capacity import PerfCapacity
from fleet.controller import Controller, ControllerSettings
from fleet.health import CircuitBreaker, HealthState
from fleet.options import Options, PoolModel, pool_models
from fleet.pool import PoolState, ReplicaState
from fleet.rollout import SlotState
from fleet.telemetry import Telemetry
from fleet.tiers import from_objectives
from gateway.background import BackgroundTask
from gateway.config import ControllerSettingsFile, GatewayConfig
from kernels.compiler.worker import background_process_pool, terminate_process_pool

if TYPE_CHECKING:
    from fleet.compile_sources import WorkerConfigSource
    from gateway.replicas import ReplicaControl
    from gateway.state import GatewayState

_DEFAULT_MAX_RUNNING = 256


def controller_settings(config: GatewayConfig, model: str, gpu_to_budget: dict[str, int]) -> ControllerSettings:
    """The controller's settings for ``config``'s tiers and a budget of replica slots per GPU kind."""
    return ControllerSettings(model=model, gpu_to_budget=gpu_to_budget, tiers=from_objectives(config.tiers))


def new_pool(name: str, model: str, gpu: str, config_json: str) -> PoolState:
    """A pool the controller made (named ``<shape>@<gpu>``), sized by its engine configuration."""
    engine = orjson.loads(config_json)
    max_running = engine.get("max_running_requests") or _DEFAULT_MAX_RUNNING
    return PoolState(name, frozenset({model}), frozenset({name.split("@", 1)[0]}), gpu, int(max_running))


def new_replica(state: GatewayState, name: str, url: str, pool: str) -> ReplicaState:
    upstream = state.runtime.config.upstream
    return ReplicaState(name, url, pool, CircuitBreaker(upstream.eject_after_failures, upstream.eject_cooldown_s), affinity_salt=zlib.crc32(url.encode()))


def swap_pools(state: GatewayState, pools: tuple[PoolState, ...]) -> None:
    """Publish a new set of pools (the event loop's only writer swaps them whole); requests waiting in
    the pools' queues follow them, and a replica just added takes some at once."""
    state.runtime = dataclasses.replace(state.runtime, pools=pools, replica_by_name={r.name: r for p in pools for r in p.replicas})
    if state.proxy is not None:
        state.proxy.waits.attach(state.runtime, asyncio.get_running_loop().time())


EJECTED_DEAD_AFTER_COOLDOWNS = 3.0  # a replica out of service this many eject cool-downs in a row is lost


class EjectionWatch:
    """Slots whose replica the gateway has kept out of service (circuit breaker not healthy) for longer than
    ``EJECTED_DEAD_AFTER_COOLDOWNS`` cool-downs count as not alive: a hung process still runs, but its GPUs
    serve nothing, so the controller takes them out of its budget as it does for an exited one."""

    def __init__(self) -> None:
        self._down: dict[str, tuple[float, int, int]] = {}  # slot -> (first seen out of service, failures and ejections then)

    def apply(self, slots: list[SlotState], breakers: Mapping[str, CircuitBreaker], now: float) -> list[SlotState]:
        """``now`` on the breakers' clock; a slot the gateway does not route (starting, stopped) is left as it is."""
        out, down = [], {}
        for slot in slots:
            breaker = breakers.get(slot.slot)
            if breaker is None or breaker.state is HealthState.HEALTHY:
                out.append(slot)
                continue
            since, failures, ejections = self._down.get(slot.slot, (now, breaker.consecutive_failures, breaker.num_ejections))
            # Within one run of failures each re-ejection (a failed trial) adds a failure; after a success the
            # count restarts and the first ejection takes ``eject_after`` failures: fewer new failures than new
            # ejections means the replica served in between, so it has been out of service only since now.
            if breaker.consecutive_failures - failures < breaker.num_ejections - ejections:
                since = now
            down[slot.slot] = (since, breaker.consecutive_failures, breaker.num_ejections)
            dead = now - since > EJECTED_DEAD_AFTER_COOLDOWNS * breaker.cooldown_s
            out.append(dataclasses.replace(slot, alive=False) if dead else slot)
        self._down = down
        return out


class LiveFleet:
    """The ``Routing`` of the controller's actuator over this gateway's pools, and the loop that ticks it."""

    def __init__(self, state: GatewayState, control: ReplicaControl, model: str, speed: float, settings: ControllerSettingsFile) -> None:
        self.state = state
        self.control = control
        self.model = model
        self.speed = speed
        self.settings = settings
        self.loop: asyncio.AbstractEventLoop | None = None
        self.telemetry = Telemetry()
        self.controller: Controller | None = None
        self.configs: WorkerConfigSource | None = None  # compiled configurations for the controller (fleet.controller.compile_store)
        self.task = BackgroundTask(self._run)
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="polymorph-controller")
        self.capacity_pool: ProcessPoolExecutor | None = None
        self._modelled: Options | None = None  # the options the pools were last modelled from
        self.pool_to_model: dict[str, PoolModel] = {}
        self.ejections = EjectionWatch()

    def adopt(self) -> None:
        """Route the actuator's moves through this gateway's pools; its slots are the controller's budget."""
        self.control.routing = self
        gpu_to_budget: dict[str, int] = {}
        for slot in self.control.slot_states():
            gpu_to_budget[slot.gpu] = gpu_to_budget.get(slot.gpu, 0) + 1
        settings = controller_settings(self.state.runtime.config, self.model, gpu_to_budget)
        self.capacity_pool = background_process_pool(min(4, os.cpu_count() or 1))
        capacity = PerfCapacity(self.model, self.settings.capacity_cache, executor=self.capacity_pool)
        self.controller = Controller(settings, self.telemetry, capacity, self.control, self.telemetry.window(0.0), self.configs)

    # -- Routing (called from the controller's and the actuator's threads; effects go to the loop) --

    def _on_loop(self, fn: Callable[[], None]) -> None:
        assert self.loop is not None
        self.loop.call_soon_threadsafe(fn)

    def _replica(self, slot: str) -> ReplicaState | None:
        return self.state.runtime.replica_by_name.get(slot)

    def drain(self, slot: str) -> None:
        replica = self._replica(slot)
        if replica is not None:
            self._on_loop(lambda: setattr(replica, "draining", True))

    def num_in_flight(self, slot: str) -> int:
        replica = self._replica(slot)
        return replica.num_in_flight if replica is not None else 0

    def remove(self, slot: str) -> None:
        self._on_loop(lambda: self._remove_replica(slot))

    def add(self, slot: str, url: str, pool: str, gpu: str, config_json: str) -> None:
        self._on_loop(lambda: self._add_replica(slot, url, pool, gpu, config_json))

    # -- changes to the gateway's pools (on the event loop) ------------------------------------

    def _remove_replica(self, slot: str) -> None:
        for pool in self.state.runtime.pools:
            pool.replicas[:] = [r for r in pool.replicas if r.name != slot]
        swap_pools(self.state, self.state.runtime.pools)

    def _add_replica(self, slot: str, url: str, pool_name: str, gpu: str, config_json: str) -> None:
        pools = list(self.state.runtime.pools)
        pool = next((p for p in pools if p.name == pool_name), None)
        if pool is None:
            pool = new_pool(pool_name, self.model, gpu, config_json)
            if pool_name in self.pool_to_model:
                self.pool_to_model[pool_name].apply(pool)
            pools.append(pool)
        pool.replicas.append(new_replica(self.state, slot, url, pool_name))
        swap_pools(self.state, tuple(pools))

    def _model_pools(self, models: dict[str, PoolModel]) -> None:
        """The router's view of each planned pool (SLO-chance scoring, saturation, overflow cost),
        as the simulator's router gets it after a plan."""
        self.pool_to_model = models
        for pool in self.state.runtime.pools:
            if pool.name in models:
                models[pool.name].apply(pool)
        if self.state.proxy is not None:  # modelled pools queue, and one sized for more concurrency has room now
            self.state.proxy.waits.attach(self.state.runtime, asyncio.get_running_loop().time())

    # -- the loop ---------------------------------------------------------------------------

    def now(self) -> float:
        """Fleet time: emulated GPUs at ``--speed X`` live X seconds per wall second, and so do the
        controller's windows, dwell times and verification delays, so a live run at speed X makes
        the decisions the simulator makes."""
        assert self.loop is not None
        return self.loop.time() * self.speed

    def _tick(self, now: float) -> None:
        assert self.controller is not None
        breakers = {name: r.breaker for name, r in self.state.runtime.replica_by_name.items()}
        slots = self.ejections.apply(self.control.slot_states(), breakers, now / self.speed)  # breakers run on the loop's clock
        decisions = self.controller.tick(now, slots)
        options = self.controller.options
        if options is not None and options is not self._modelled:
            self._modelled = options
            models = pool_models(options, self.controller.reference_mix)
            self._on_loop(lambda: self._model_pools(models))
        if decisions:
            wall = [dataclasses.replace(d, at=d.at / self.speed) for d in decisions]
            self._on_loop(lambda: self.state.decisions.extend(wall))

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.settings.tick_s / self.speed)
            try:
                await loop.run_in_executor(self.executor, self._tick, self.now())
            except Exception as exc:  # noqa: BLE001 (the gateway keeps routing on the last plan)
                print(f"polymorph: controller tick failed, keeping the current plan: {exc!r}", flush=True)

    def start_loop(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.state.decisions.open(self.settings.decision_log)
        self.state.decisions.clock_offset_s = time.time() - self.loop.time()
        self.task.start()

    async def stop_loop(self) -> None:
        await self.task.stop()
        if self.capacity_pool is not None:
            terminate_process_pool(self.capacity_pool)  # a tick waiting on a capacity evaluation fails at once
        self.executor.shutdown(wait=False, cancel_futures=True)
        self.control.routing = None  # the pools die with the event loop: shutdown's stops route nowhere
        if self.configs is not None:
            self.configs.close()
