"""The control loop, live: the fleet controller and operator moves inside the gateway, over its launched replicas.

The controller and its policy objects are the ones the simulator runs (fleet/controller.py); this
module is only their I/O edge, and everything it does to the pools happens on the event loop, their
only writer:

    snapshot (on the loop) -> controller.tick(now, snapshot) in a worker thread (a re-plan consults
    the performance model for seconds) -> the commands applied back on the loop

``LiveFleet`` is the commands' ``Actuator`` (fleet.commands): drain marks a replica unroutable, stop
takes it out of its pool and ends its process, start launches the slot's new configuration, activate
puts the started replica into its (possibly new) pool. Processes are the ``ReplicaControl``'s that
``fleet.actuator`` chose (gateway.replicas: local processes or Ray actors). What came of a command
(a start answered /health, a drained replica's requests finished) is the next snapshot's facts.
Operator moves (``POST /admin/move``, fleet.operator) go through the same commands; while one runs
the controller waits, and the controller's rollouts refuse them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
import zlib
from collections.abc import Mapping
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from typing import TYPE_CHECKING

import orjson

from fleet.canary_trial import CanaryTrials
from fleet.capacity import PerfCapacity
from fleet.commands import Command, TickOutput, apply
from fleet.controller import Controller, ControllerSettings
from fleet.decisions import Decision
from fleet.health import CircuitBreaker, HealthState
from fleet.multi import ModelTelemetry, MultiController, SlotSplit, split_slots
from fleet.operator import MoveRefused, OperatorMoves
from fleet.options import DeclaredPool, Options, PoolModel, pool_models, pool_name
from fleet.pool import PoolState, ReplicaState
from fleet.rebalance import RebalanceSettings
from fleet.restart_hold import Restart
from fleet.rollout import SlotState
from gateway.background import BackgroundTask
from gateway.config import ControllerSettingsFile, GatewayConfig, PoolSpec
from gateway.replicas import made_pool_engine, pool_server
from gateway.runtime import max_running_per_replica
from kernels.compiler.worker import background_process_pool, terminate_process_pool
from kernels.config import EngineConfig

if TYPE_CHECKING:
    from fleet.compile_sources import WorkerConfigSource
    from gateway.replicas import ReplicaControl
    from gateway.state import GatewayState

# Wall seconds a replica's process may take to start beyond what the move cost predicts. An emulated H100
# restart is 28 fleet seconds, so at emulator speed 20 the default deadline (4x) left 5.6 wall seconds for
# the process, its imports and (with the Ray actuator) its actor: a quiet machine's move took 3-5 s, and on a
# busy CI runner a start missed it and was rolled back as never healthy.
PROCESS_START_ALLOWANCE_S = 15.0


def controller_settings(config: GatewayConfig, model: str, gpu_to_budget: dict[str, int], pool_prefix: str = "") -> ControllerSettings:
    """The controller's settings for ``config``'s tiers and a budget of replica slots per GPU kind; its
    starting plan is ``config``'s pools of ``model`` whose replicas the actuator starts (their slots
    already serve in them), which it keeps while they fit the mix; ``pool_prefix`` names the pools it makes."""
    declared = tuple(declared_pool(p) for p in config.pools if p.model == model and p.gpu in gpu_to_budget and not p.urls)
    # the engine of a made pool depends on its GPU kind and model, not its shape: any shape names it
    engines = {gpu: made_pool_engine(config, pool_name("", gpu, pool_prefix), gpu) for gpu in gpu_to_budget}
    made = {gpu: found for gpu, spec in engines.items() if spec is not None and (found := pool_server(spec)) is not None}
    c = config.controller
    return ControllerSettings(model=model, gpu_to_budget=gpu_to_budget, tiers=dict(config.tiers), declared=declared, pool_prefix=pool_prefix,
                              made_engines=made,
                              drift=c.drift, verify_after_s=c.verify_after_s, backoff_s=c.backoff_s,
                              min_start_timeout_s=PROCESS_START_ALLOWANCE_S * config.emulator_speed)


def declared_pool(spec: PoolSpec) -> DeclaredPool:
    """A config pool as the planner takes it (its GPU kind set: the caller's filter)."""
    assert spec.gpu is not None
    return DeclaredPool(spec.name, spec.gpu, spec.shapes, EngineConfig.from_dict(spec.engine), spec.config_json, pool_server(spec))


def model_pools(state: GatewayState, models: Mapping[str, PoolModel]) -> None:
    """The router's view of each modelled pool (SLO-chance scoring, saturation, overflow cost), as the
    simulator's router gets it after a plan; on the event loop."""
    for pool in state.runtime.pools:
        found = models.get(pool.name)
        if found is not None:
            found.apply(pool)
    if state.proxy is not None:  # modelled pools queue, and one sized for more concurrency has room now
        state.proxy.waits.attach(state.runtime, asyncio.get_running_loop().time())


def new_pool(name: str, model: str, gpu: str, config_json: str, engine: PoolSpec | None = None) -> PoolState:
    """A pool the controller made (named ``[<model>:]<shape>@<gpu>``: no declared pool served its shape on
    that GPU kind), run by ``engine``'s engine (gateway.replicas.made_pool_engine: the declared pool whose
    engine the actuator launches it with; None: emulated). It is sized by its engine configuration as that
    engine runs it on ``gpu`` (llama-server's slots or vLLM's sequences where the configuration leaves them
    unset), its replicas are read and given priorities as that engine's, and it serves ``model`` and the
    LoRA adapters the engine loads."""
    config = EngineConfig.from_dict(orjson.loads(config_json))
    engine_kind = "emulated" if engine is None else engine.engine_kind
    shape = name.split("@", 1)[0].removeprefix(f"{model}:")
    adapters = engine.adapter_names if engine is not None else frozenset()
    return PoolState(name, frozenset({model, *adapters}), frozenset({shape}), gpu, max_running_per_replica(config, engine_kind, gpu),
                     engine_kind=engine_kind, priority_scheduling=config.schedule_policy == "priority")


def new_replica(state: GatewayState, name: str, url: str, pool: str) -> ReplicaState:
    upstream = state.runtime.config.upstream
    return ReplicaState(name, url, pool, CircuitBreaker(upstream.eject_after_failures, upstream.eject_cooldown_s), affinity_salt=zlib.crc32(url.encode()))


def swap_pools(state: GatewayState, pools: tuple[PoolState, ...]) -> None:
    """Publish a new set of pools (the event loop's only writer swaps them whole); requests waiting in
    the pools' queues follow them, and a replica just added takes some at once."""
    state.runtime = dataclasses.replace(state.runtime, pools=pools, replica_by_name={r.name: r for p in pools for r in p.replicas})
    if state.proxy is not None:
        state.proxy.waits.attach(state.runtime, asyncio.get_running_loop().time())
        state.proxy.holds.wake(asyncio.get_running_loop().time())  # a replica back in service takes the requests held for it


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


OPERATOR_TICK_S = 0.25  # wall seconds between an operator move's ticks: a drain or a start is noticed this soon


class LiveFleet:
    """The control loop over this gateway's pools, and the ``Actuator`` that applies its commands.
    ``controller`` is None when ``fleet.controller`` is off: operator moves still run. With launched pools
    of several models, each model's controller plans the slots its pools held at adoption (fleet.multi), and
    the arbiter (fleet.rebalance) moves a slot to another model when that model's plan needs it."""

    owns_pools = True

    def __init__(self, state: GatewayState, control: ReplicaControl, models: tuple[str, ...], speed: float, settings: ControllerSettingsFile) -> None:
        self.state = state
        self.control = control
        self.speed = speed
        self.settings = settings
        self.loop: asyncio.AbstractEventLoop | None = None
        self.telemetry = ModelTelemetry(models, settings.window_s)
        self.split = SlotSplit({}, {})  # which model owns each launched slot (set by ``adopt``)
        self.controller: MultiController | None = None
        self.configs: WorkerConfigSource | None = None  # compiled configurations for the controller (fleet.controller.compile_store)
        self.task = BackgroundTask(self._run)
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="polymorph-controller")
        self.capacity_pool: ProcessPoolExecutor | None = None
        self._modelled: dict[str, tuple[Options, dict[str, PoolModel]]] = {}  # per model: the options its pools were last modelled from
        self.pool_to_model: dict[str, PoolModel] = {}
        self.ejections = EjectionWatch()
        self.operator = OperatorMoves()
        self.canary = CanaryTrials(state.replica_outcomes, settings.canary)

    def adopt(self) -> None:
        """Each launched slot belongs to the model of the pool it serves in now; the slots of a model are
        its controller's budget, and the config's launched pools of that model its starting plan (when
        ``fleet.controller`` is on)."""
        pool_to_model = {p.name: p.model for p in self.state.runtime.config.pools}
        self.split = split_slots(self.control.slot_states(), pool_to_model)
        if not self.settings.enabled:
            return
        self.capacity_pool = background_process_pool(min(4, os.cpu_count() or 1))
        models = self.split.models()
        controllers = {}
        for model in models:
            settings = controller_settings(self.state.runtime.config, model, dict(self.split.model_to_budget[model]),
                                           f"{model}:" if len(models) > 1 else "")
            capacity = PerfCapacity(model, self.settings.capacity_cache, executor=self.capacity_pool)
            telemetry = self.telemetry.of(model)
            # a compiled-configuration source compiles for one model (CompileSettings.model)
            configs = self.configs if len(models) == 1 else None
            canary = CanaryTrials(self.state.replica_outcomes, self.settings.canary) if self.settings.canary.enabled else None
            controllers[model] = Controller(settings, telemetry, capacity, telemetry.window(0.0), configs, canary)
        rebalance = (RebalanceSettings(self.settings.rebalance_cooldown_s, self.settings.rebalance_min_gain)
                     if self.settings.rebalance else None)
        self.controller = MultiController(controllers, self.split.slot_to_model, rebalance)

    # -- operator moves (on the event loop) ----------------------------------------------------

    def request_move(self, replica: str, to_pool: str) -> list[Decision]:
        """Start moving ``replica`` into ``to_pool`` (with that pool's configuration); its first commands
        are applied at once. Raises ``MoveRefused`` (with the HTTP status) when it cannot start."""
        config_json = self._pool_config_json(to_pool)
        if config_json is None:
            raise MoveRefused(404, f"no pool named {to_pool!r}")
        model, to_model = self.split.slot_to_model.get(replica), self._pool_model(to_pool)
        if model is not None and to_model is not None and model != to_model:
            raise MoveRefused(409, f"replica {replica!r} serves {model!r} and pool {to_pool!r} serves {to_model!r}; "
                                   "a move between models' pools is not supported (each model's controller owns its slots)")
        if self.controller is not None and self.controller.busy:
            raise MoveRefused(409, "the fleet controller is carrying out a repartition; try again when it is done")
        if self.canary.busy:
            raise MoveRefused(409, f"a canary of pool {self.canary.pool!r} is running; try again when it is done")
        now = self.now()
        out = self.operator.request(now, self.snapshot(now), replica, to_pool, config_json, self._pool_gpu(to_pool))
        self._apply(out, now)
        return out.decisions

    def request_canary(self, pool: str, changes: Mapping[str, object]) -> list[Decision]:
        """Trial the pool's engine configuration with ``changes`` (EngineConfig knobs) on one replica of ``pool``
        against its siblings (fleet.canary_trial); its first commands are applied at once. Raises ``MoveRefused``
        (with the HTTP status) when it cannot start."""
        now = self.now()
        slots = self.snapshot(now)
        current = next((s.config_json for s in sorted(slots, key=lambda s: s.slot) if s.pool == pool), None)
        if current is None:
            raise MoveRefused(404, f"no replica launched by this gateway serves in pool {pool!r}")
        merged = {**orjson.loads(current), **changes}
        try:
            old, new = EngineConfig.from_dict(orjson.loads(current)), EngineConfig.from_dict(merged)
        except (ValueError, TypeError) as exc:
            raise MoveRefused(400, f"config: {exc}") from None
        if new.num_gpus != old.num_gpus:
            raise MoveRefused(400, f"config: a canary restarts on its slot's {old.num_gpus} device(s); tp x dp must stay {old.num_gpus}")
        if self.operator.busy:
            raise MoveRefused(409, f"replica {self.operator.moving} is being moved; try again when it is done")
        if self.controller is not None and self.controller.busy:
            raise MoveRefused(409, "the fleet controller is carrying out a repartition; try again when it is done")
        config_json = orjson.dumps(merged, option=orjson.OPT_SORT_KEYS).decode()  # as PoolSpec.config_json spells it
        out = self.canary.request(now, slots, pool, config_json, source="operator")
        self._apply(out, now)
        return out.decisions

    def replica_process(self, name: str) -> dict[str, object] | None:
        """What ``/admin/state`` shows of a replica this gateway launched: its engine's command line,
        devices and the pool its slot serves (None: not one of its slots)."""
        found = self.control.slot_state(name)
        if found is None:
            return None
        return {"slot_pool": found.pool, "alive": found.alive, "healthy": found.healthy, "devices": list(self.control.devices(name)),
                "argv": list(self.control.argv(name) or ()), "error": self.control.error(name),
                "moving": self.operator.busy and self.operator.moving == name}

    def _pool_config_json(self, pool: str) -> str | None:
        """The configuration a replica moved into ``pool`` starts with: the one its live replicas all run (a
        canary's adopted configuration, or a controller's recompile: what the pool runs, not what was
        declared), else the controller's plan for it, else the declared one (None: no such pool)."""
        running = self.running_configs_json().get(pool)
        if running is not None:
            return running
        for controller in self.controller.model_to_controller.values() if self.controller is not None else ():
            found = controller.options.configs_json().get(pool) if controller.options is not None else None
            if found is not None:
                return found
        return next((spec.config_json for spec in self.state.runtime.config.pools if spec.name == pool), None)

    def running_configs_json(self) -> dict[str, str]:
        """Per pool, the configuration every live launched replica of it runs (left out: none runs, or they differ mid-rollout)."""
        pool_to_texts: dict[str, set[str]] = {}
        for slot in self.control.slot_states():
            if slot.alive:
                pool_to_texts.setdefault(slot.pool, set()).add(slot.config_json)
        return {pool: next(iter(texts)) for pool, texts in pool_to_texts.items() if len(texts) == 1}

    def _pool_gpu(self, pool: str) -> str | None:
        """The device kind of a config pool, or of a pool a controller made (None: the pool names none)."""
        for spec in self.state.runtime.config.pools:
            if spec.name == pool:
                return spec.gpu
        for controller in self.controller.model_to_controller.values() if self.controller is not None else ():
            found = next((option.gpu for option in controller.options.pools if option.name == pool), None) if controller.options else None
            if found is not None:
                return found
        return None

    def _pool_model(self, pool: str) -> str | None:
        """The model a config pool serves, or the model whose controller made the pool (None: unknown)."""
        for spec in self.state.runtime.config.pools:
            if spec.name == pool:
                return spec.model
        for model, controller in self.controller.model_to_controller.items() if self.controller is not None else ():
            if controller.options is not None and pool in controller.options.configs_json():
                return model
        return None

    def _apply(self, out: TickOutput, now: float) -> None:
        apply(out.commands, self, now)
        if out.decisions:
            self.state.decisions.extend([dataclasses.replace(d, at=d.at / self.speed) for d in out.decisions])

    # -- the Actuator (fleet.commands), on the event loop -------------------------------------

    def drain(self, slot: str, now: float) -> None:
        replica = self.state.runtime.replica_by_name.get(slot)
        if replica is not None:
            replica.draining = True

    def stop(self, slot: str, now: float) -> None:
        self.control.stop(slot, now)
        for pool in self.state.runtime.pools:
            pool.replicas[:] = [r for r in pool.replicas if r.name != slot]
        swap_pools(self.state, self.state.runtime.pools)

    def start(self, slot: str, pool: str, config_json: str, now: float) -> None:
        self.control.start(slot, pool, config_json, now)

    def activate(self, slot: str, now: float) -> None:
        url = self.control.url(slot)
        found = self.control.slot_state(slot)
        assert url is not None and found is not None, f"{slot} activated before it was started"
        pools = list(self.state.runtime.pools)
        pool = next((p for p in pools if p.name == found.pool), None)
        if pool is None:
            pool = new_pool(found.pool, self.split.slot_to_model[slot], found.gpu, found.config_json,
                            made_pool_engine(self.state.runtime.config, found.pool, found.gpu))
            if found.pool in self.pool_to_model:
                self.pool_to_model[found.pool].apply(pool)
            pools.append(pool)
        pool.replicas.append(new_replica(self.state, slot, url, found.pool))
        swap_pools(self.state, tuple(pools))

    def _model_pools(self, models: dict[str, PoolModel]) -> None:
        self.pool_to_model = models
        model_pools(self.state, models)

    # -- the loop ---------------------------------------------------------------------------

    def now(self) -> float:
        """Fleet time: emulated GPUs at ``--speed X`` live X seconds per wall second, and so do the
        controller's windows, dwell times and verification delays, so a live run at speed X makes
        the decisions the simulator makes."""
        assert self.loop is not None
        return self.loop.time() * self.speed

    def snapshot(self, now: float) -> list[SlotState]:
        """The slots as the tick sees them (on the loop): the actuator's processes, the router's
        in-flight counts, each engine's last /metrics figures, and slots the gateway has kept out of
        service for long counted as dead."""
        replicas = self.state.runtime.replica_by_name
        slots = [dataclasses.replace(s, num_in_flight=replicas[s.slot].num_in_flight, engine=replicas[s.slot].engine)
                 if s.slot in replicas else s for s in self.control.slot_states()]
        breakers = {name: r.breaker for name, r in replicas.items()}
        return self.ejections.apply(slots, breakers, now / self.speed)  # breakers run on the loop's clock

    def _tick(self, now: float, slots: list[SlotState]) -> list[Command]:
        """Off the loop: the controller's decisions; the commands go back to the loop."""
        assert self.controller is not None
        out = self.controller.tick(now, slots)
        # a slot the arbiter gave another model starts (and activates) as that model's (fleet.rebalance)
        self.split = self.controller.split()
        changed = False
        for model, controller in self.controller.model_to_controller.items():
            options = controller.options
            if options is not None and (model not in self._modelled or options is not self._modelled[model][0]):
                self._modelled[model] = (options, pool_models(options, controller.reference_mix, controller.settings.tiers))
                changed = True
        if changed:
            models = {pool: found for _, by_pool in self._modelled.values() for pool, found in by_pool.items()}
            assert self.loop is not None
            self.loop.call_soon_threadsafe(lambda: self._model_pools(models))
        if out.decisions:
            wall = [dataclasses.replace(d, at=d.at / self.speed) for d in out.decisions]
            assert self.loop is not None
            self.loop.call_soon_threadsafe(lambda: self.state.decisions.extend(wall))
        return out.commands

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        tick_s = self.settings.tick_s / self.speed
        controller_at = loop.time() + tick_s
        while True:
            # short naps: an operator move asked for between controller ticks starts its next phase soon
            await asyncio.sleep(min(tick_s, OPERATOR_TICK_S))
            try:
                now = self.now()
                if self.operator.busy:  # the controller waits for it: both would move the same slots
                    self._apply(self.operator.tick(now, self.snapshot(now)), now)
                elif self.canary.busy:  # so it does for a canary trial
                    self._apply(self.canary.tick(now, self.snapshot(now)), now)
                elif self.controller is not None and loop.time() >= controller_at - 1e-3:
                    controller_at = loop.time() + tick_s
                    commands = await loop.run_in_executor(self.executor, self._tick, now, self.snapshot(now))
                    apply(commands, self, self.now())
            except Exception as exc:  # noqa: BLE001 (the gateway keeps routing on the last plan)
                print(f"polymorph: controller tick failed, keeping the current plan: {exc!r}", flush=True)

    def restarts(self) -> list[Restart]:
        """Launched replicas out of service for a move that brings them back (fleet.restart_hold): draining
        ones, in the pool they leave, and started ones not yet routed, in the pool they start in."""
        routed, out = self.state.runtime.replica_by_name, []
        for slot, model in self.split.slot_to_model.items():
            replica = routed.get(slot)
            if replica is not None:
                if replica.draining:
                    out.append(Restart(slot, replica.pool, model))
                continue
            found = self.control.slot_state(slot)
            if found is not None and found.alive:  # its engine runs (starting); a failed start's process has exited
                out.append(Restart(slot, found.pool, model))
        return out

    def start_loop(self) -> None:
        self.loop = asyncio.get_running_loop()
        if self.state.proxy is not None:
            self.state.proxy.holds.connect(self.restarts, lambda: self.state.runtime.pools)
        self.state.decisions.open(self.settings.decision_log)
        self.state.decisions.clock_offset_s = time.time() - self.loop.time()
        self.task.start()

    async def stop_loop(self) -> None:
        await self.task.stop()
        if self.capacity_pool is not None:
            terminate_process_pool(self.capacity_pool)  # a tick waiting on a capacity evaluation fails at once
        self.executor.shutdown(wait=False, cancel_futures=True)
        if self.configs is not None:
            self.configs.close()
