"""The control loop, live: the fleet controller ticking inside the gateway over emulated replicas.

The controller and its policy objects are the ones the simulator runs (fleet/controller.py); this
module is only their I/O edge. ``LiveFleet`` implements the controller's ``Actuator`` protocol over
the gateway's pools and the local actuator's processes: drain marks a replica unroutable, stop ends
its process, start launches a replica with the new engine configuration on a free port and probes its
``/health``, activate puts it into its (possibly new) pool. Every call returns at once, as the
protocol asks. A tick runs in a worker thread, because a re-plan consults the performance model for
seconds; its effects on the gateway's state are handed back to the event loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import urllib.error
import urllib.request
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import orjson

from fleet.actuators.local import (
    LaunchSpec,
    LocalActuator,
    LocalReplica,
    emulated_replica_argv,
)
from fleet.capacity import PerfCapacity
from fleet.controller import Controller, ControllerSettings
from fleet.health import CircuitBreaker
from fleet.pool import PoolState, ReplicaState
from fleet.rollout import SlotState
from fleet.telemetry import Telemetry
from fleet.tiers import TierSlo
from gateway.background import BackgroundTask
from gateway.config import ControllerSettingsFile

if TYPE_CHECKING:
    from gateway.state import GatewayState

_DEFAULT_MAX_RUNNING = 256


@dataclass(slots=True)
class _Slot:
    name: str
    gpu: str
    pool: str
    config_json: str
    process: LocalReplica | None
    healthy: bool = False


class LiveFleet:
    """The controller's actuator over this gateway's emulated replicas, and the loop that ticks it."""

    def __init__(self, state: GatewayState, local: LocalActuator, command: tuple[str, ...], model: str, speed: float, settings: ControllerSettingsFile) -> None:
        self.state = state
        self.local = local
        self.command = command
        self.model = model
        self.speed = speed
        self.settings = settings
        self.loop: asyncio.AbstractEventLoop | None = None
        self.slots: dict[str, _Slot] = {}
        self.stopping: list[LocalReplica] = []
        self.telemetry = Telemetry()
        self.controller: Controller | None = None
        self.task = BackgroundTask(self._run)
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="polymorph-controller")

    # -- set-up ------------------------------------------------------------------------------

    def adopt(self) -> None:
        """Take the emulated replicas the gateway started as the controller's slots."""
        by_url = {r.url: r for r in self.local.replicas}
        config = self.state.runtime.config
        engine_by_pool = {p.name: dict(p.engine) for p in config.pools}
        gpu_to_budget: dict[str, int] = {}
        for pool in self.state.runtime.pools:
            for replica in pool.replicas:
                process = by_url.get(replica.url)
                if process is None or pool.gpu is None:
                    continue  # static replicas are not the controller's to move
                config_json = orjson.dumps(engine_by_pool.get(pool.name, {}), option=orjson.OPT_SORT_KEYS).decode()
                self.slots[replica.name] = _Slot(replica.name, pool.gpu, pool.name, config_json, process, healthy=True)
                gpu_to_budget[pool.gpu] = gpu_to_budget.get(pool.gpu, 0) + 1
        # a request of a higher tier is worth twice one of the next lower tier (the fleet's default weights)
        lowest = max(t.priority for t in config.tiers.values())
        tiers = {name: TierSlo(t.ttft_p99_s, t.tpot_p99_s, 2.0 ** (lowest - t.priority), t.priority) for name, t in config.tiers.items()}
        settings = ControllerSettings(model=self.model, gpu_to_budget=gpu_to_budget, tiers=tiers)
        capacity = PerfCapacity(self.model, self.settings.capacity_cache)
        self.controller = Controller(settings, self.telemetry, capacity, self, self.telemetry.window(0.0))

    def slot_states(self) -> list[SlotState]:
        return [SlotState(s.name, s.pool, s.gpu, s.config_json) for s in self.slots.values()]

    # -- the Actuator protocol (called from the controller's thread; effects go to the loop) -----

    def _on_loop(self, fn: Callable[[], None]) -> None:
        assert self.loop is not None
        self.loop.call_soon_threadsafe(fn)

    def _replica(self, slot: str) -> ReplicaState | None:
        return self.state.runtime.replica_by_name.get(slot)

    def drain(self, slot: str, now: float) -> None:
        replica = self._replica(slot)
        if replica is not None:
            self._on_loop(lambda: setattr(replica, "draining", True))

    def num_in_flight(self, slot: str) -> int:
        replica = self._replica(slot)
        return replica.num_in_flight if replica is not None else 0

    def stop(self, slot: str, now: float) -> None:
        found = self.slots[slot]
        process, found.process, found.healthy = found.process, None, False
        if process is not None:
            process.process.terminate()  # reaped by a later tick; never waits here
            self.stopping.append(process)
        self._on_loop(lambda: self._remove_replica(slot))

    def start(self, slot: str, pool: str, config_json: str, now: float) -> None:
        found = self.slots[slot]
        argv = emulated_replica_argv(self.command, self.model, found.gpu, config_json, self.speed)
        found.process = self.local.start(LaunchSpec(f"{slot}-{int(time.time())}", argv))
        found.pool, found.config_json, found.healthy = pool, config_json, False
        self.executor.submit(self._wait_healthy, found)

    def _wait_healthy(self, found: _Slot) -> None:
        process = found.process
        deadline = time.monotonic() + 120.0
        while process is not None and process is found.process and time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(process.url + "/health", timeout=1.0) as resp:
                    if resp.status == 200:
                        found.healthy = True
                        return
            except (urllib.error.URLError, OSError):
                time.sleep(0.2)

    def is_healthy(self, slot: str, now: float) -> bool:
        return self.slots[slot].healthy

    def activate(self, slot: str, now: float) -> None:
        found = self.slots[slot]
        assert found.process is not None
        url, pool, gpu, config_json = found.process.url, found.pool, found.gpu, found.config_json
        self._on_loop(lambda: self._add_replica(slot, url, pool, gpu, config_json))

    # -- changes to the gateway's pools (on the event loop) ------------------------------------

    def _swap_pools(self, pools: tuple[PoolState, ...]) -> None:
        runtime = self.state.runtime
        self.state.runtime = dataclasses.replace(
            runtime, pools=pools, replica_by_name={r.name: r for p in pools for r in p.replicas}
        )

    def _remove_replica(self, slot: str) -> None:
        for pool in self.state.runtime.pools:
            pool.replicas[:] = [r for r in pool.replicas if r.name != slot]
        self._swap_pools(self.state.runtime.pools)

    def _add_replica(self, slot: str, url: str, pool_name: str, gpu: str, config_json: str) -> None:
        upstream = self.state.runtime.config.upstream
        pools = list(self.state.runtime.pools)
        pool = next((p for p in pools if p.name == pool_name), None)
        if pool is None:
            engine = orjson.loads(config_json)
            max_running = engine.get("max_running_requests") or _DEFAULT_MAX_RUNNING
            shape = pool_name.split("@", 1)[0]
            pool = PoolState(pool_name, frozenset({self.model}), frozenset({shape}), gpu, int(max_running))
            pools.append(pool)
        pool.replicas.append(
            ReplicaState(slot, url, pool_name, CircuitBreaker(upstream.eject_after_failures, upstream.eject_cooldown_s), affinity_salt=zlib.crc32(url.encode()))
        )
        self._swap_pools(tuple(pools))

    # -- the loop ---------------------------------------------------------------------------

    def now(self) -> float:
        """Fleet time: emulated GPUs at ``--speed X`` live X seconds per wall second, and so do the
        controller's windows, dwell times and verification delays, so a live run at speed X makes
        the decisions the simulator makes."""
        assert self.loop is not None
        return self.loop.time() * self.speed

    def _tick(self, now: float) -> None:
        assert self.controller is not None
        for process in [p for p in self.stopping if p.process.poll() is not None]:
            self.stopping.remove(process)
            if process in self.local.replicas:
                self.local.replicas.remove(process)
        decisions = self.controller.tick(now, self.slot_states())
        if decisions:
            wall = [dataclasses.replace(d, at=d.at / self.speed) for d in decisions]
            self._on_loop(lambda: self.state.decisions.extend(wall))

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.settings.tick_s / self.speed)
            try:
                await loop.run_in_executor(self.executor, self._tick, self.now())
            except Exception as exc:  # the gateway keeps routing on the last plan
                print(f"polymorph: controller tick failed, keeping the current plan: {exc!r}", flush=True)

    def start_loop(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.state.decisions.path = self.settings.decision_log
        self.state.decisions.clock_offset_s = time.time() - self.loop.time()
        self.task.start()

    async def stop_loop(self) -> None:
        await self.task.stop()
        self.executor.shutdown(wait=False, cancel_futures=True)
