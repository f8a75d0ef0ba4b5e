"""The capacity model of the pools this gateway routes to but does not launch (``urls`` pools).

No actuator restarts or moves those replicas, so no controller plans them; but the router's SLO-chance
scoring, the pools' queues and the shedding of requests that would miss all work from each pool's
capacity (fleet.options.PoolModel), and the performance model gives it from the pool's GPU kind,
engine settings and the traffic the gateway measures. With ``fleet.controller`` enabled and no
launched pools, every ``tick_s`` this loop takes each model's telemetry window (shapes, lengths, the
prefix cache's share), prices the model's ``urls`` pools on it with their configurations fixed, and
hands the models to the router, as a controller's plan does for launched pools (gateway.live_fleet).
It starts once the window holds ``drift.warmup_s`` of traffic, as the controller waits before it
plans: the outputs of a younger window are those that finished first, the short ones. On the routing
workload 10 s of it priced a long-context H200 replica at 2 running documents and 1.3 req/s, 20 s at
31 and 2.5 req/s, while unmodelled at half its rate the engines ran up to 27 a replica and met 89%
of them at 3.9 req/s.
The evaluations run in worker processes: seconds of perf-model work must not hold the event loop.

Measured on the routing workload (loadtest/bench/data/peers-routing.yaml) over 2 H100 chat + 2 H200
long-context replicas, the evidence is split. In the simulator (engines without prefix fingerprints, as
the live load generator sends them; 30 s runs) at 0.75x its 100 req/s the pools unmodelled kept
interactive chat at 99.8% and the standard tier at 77.5% (the documents wait for the two H200s);
modelled, the documents spill into the chat pool while its SLO chance holds: 97.1% and 93.4%. Live
(`polymorph bench peers --parts routing --metric capacity`'s search, 8 engine seconds per point) the
modelled gateway's capacity was 0.545x the rate against 0.917x unmodelled, so that bench runs without it
(fleet/README.md, with what was found since).
"""

from __future__ import annotations

import asyncio
import math
import os
import sys
from collections.abc import Mapping
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor

from fleet.capacity import CapacityModel, PerfCapacity
from fleet.multi import ModelTelemetry
from fleet.options import DeclaredPool, PoolModel, pool_models, pool_options
from fleet.telemetry import TrafficMix
from gateway.background import BackgroundTask
from gateway.config import ControllerSettingsFile, GatewayConfig
from gateway.live_fleet import declared_pool, model_pools
from gateway.state import GatewayState
from kernels.compiler.worker import background_process_pool, terminate_process_pool
from kernels.tiers import TierSlo


def modelled_pools(config: GatewayConfig) -> dict[str, tuple[DeclaredPool, ...]]:
    """Per model, the ``urls`` pools a capacity model can price: a GPU kind and a model the catalog knows."""
    from kernels.catalog import get_gpu, get_model

    out: dict[str, list[DeclaredPool]] = {}
    for spec in config.pools:
        if not spec.urls or spec.num_launched or spec.gpu is None:
            continue
        try:
            get_gpu(spec.gpu), get_model(spec.model)
        except ValueError:
            continue
        out.setdefault(spec.model, []).append(declared_pool(spec))
    return {model: tuple(pools) for model, pools in sorted(out.items())}


def price_pools(declared: tuple[DeclaredPool, ...], mix: TrafficMix, capacity: CapacityModel, tiers: Mapping[str, TierSlo]) -> dict[str, PoolModel]:
    """Each of ``declared`` (one model's pools) priced on ``mix``, every pool on the configuration its
    replicas run (an infinite restart margin: no candidate replaces it)."""
    if not mix.shapes or not declared:
        return {}
    options = pool_options(mix.shapes, tuple(sorted({d.gpu for d in declared})), capacity, tiers, declared=declared,
                           running={d.name: d.config for d in declared}, restart_margin=math.inf)
    names = {d.name for d in declared}
    return {name: model for name, model in pool_models(options, mix, tiers).items() if name in names}


class PoolModeller:
    """What ``GatewayState.live`` is for a gateway over ``urls`` pools with ``fleet.controller`` enabled:
    telemetry in, capacity models out; it moves nothing. The models it senses are those of the config it
    started with; each tick prices the ``urls`` pools of the config serving then (a reload that changes a
    pool's GPU, engine or shapes is priced from the next tick)."""

    owns_pools = False  # a config reload rebuilds the pools (their URLs may change); the next tick models them again

    def __init__(self, state: GatewayState, models: tuple[str, ...], speed: float, settings: ControllerSettingsFile) -> None:
        self.state = state
        self.models = models
        self.speed = speed
        self.settings = settings
        self.telemetry = ModelTelemetry(models, settings.window_s)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.task = BackgroundTask(self._run)
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="polymorph-pool-models")
        self.capacity_pool: ProcessPoolExecutor | None = None
        self.capacity: dict[str, PerfCapacity] = {}
        self.pool_to_model: dict[str, PoolModel] = {}

    def now(self) -> float:
        """Fleet time: the emulated replicas of ``urls`` pools marked ``kind: emulated`` live ``speed``
        seconds per wall second, and so do the telemetry windows they are priced on."""
        assert self.loop is not None
        return self.loop.time() * self.speed

    def replica_process(self, name: str) -> dict[str, object] | None:
        return None  # these replicas run elsewhere

    def start_loop(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.capacity_pool = background_process_pool(min(2, os.cpu_count() or 1))
        self.capacity = {model: PerfCapacity(model, self.settings.capacity_cache, executor=self.capacity_pool) for model in self.models}
        self.task.start()

    async def stop_loop(self) -> None:
        await self.task.stop()
        if self.capacity_pool is not None:
            terminate_process_pool(self.capacity_pool)
        self.executor.shutdown(wait=False, cancel_futures=True)

    def price(self, now: float) -> dict[str, PoolModel]:
        """Off the loop: every modelled pool's capacity on its model's current window, once that window
        holds the drift detector's warm-up (``drift.warmup_s``; see the module docstring)."""
        config = self.state.runtime.config  # swapped whole on reload: one version throughout
        out: dict[str, PoolModel] = {}
        for model, pools in modelled_pools(config).items():
            telemetry = self.telemetry.of(model)
            if model in self.capacity and self.settings.drift.warmed_up(telemetry.covered_s(now)):
                out.update(price_pools(pools, telemetry.window(now), self.capacity[model], config.tiers))
        return out

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.settings.tick_s / self.speed)
            try:
                models = await loop.run_in_executor(self.executor, self.price, self.now())
            except Exception as exc:  # noqa: BLE001 (the router keeps the models it has)
                print(f"polymorph: pricing the url pools failed, the router keeps their last models: {exc!r}", file=sys.stderr, flush=True)
                continue
            if models:
                self._apply(models)

    def _apply(self, models: dict[str, PoolModel]) -> None:
        self.pool_to_model.update(models)  # a pool this tick could not price (no load) keeps its last model
        model_pools(self.state, self.pool_to_model)

