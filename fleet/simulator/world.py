"""The simulated fleet: pools of virtual replicas behind the real router, fed by a workload.

``FleetSim`` is also the simulator's ``Actuator`` (fleet.commands), applying the controller's
commands in virtual time: drain marks a replica as draining for the router, stop removes it, start
builds a new engine with the new configuration that becomes healthy ``restart_s`` later, activate
makes it routable in its pool; ``slot_states(now)`` is the next tick's snapshot.

Every pool keeps a ``PoolQueue``, and the router is given the tiers, as a gateway would run it: a
request the best pool has no room for waits in that pool's queue (priority, then deadline) and is
admitted when a replica's in-flight count drops below the pool's saturation limit; one whose wait
budget passes, or that the router predicts cannot make its SLO, is shed (a 429 before any token:
counted in ``num_shed``, not good, and it costs no GPU time). ``dropped`` stays for requests no
replica can hold, or that a forced stop (a drain past its deadline) cuts off.
"""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np

from classifiers.shape import Shape, ShapeRules, default_shape_rules
from fleet.dispatch import Queued, pump
from fleet.health import CircuitBreaker
from fleet.options import Options, PoolModel, pool_models
from fleet.pool import PoolState, ReplicaState
from fleet.queueing import PoolQueue, Shed
from fleet.rollout import SlotState
from fleet.router import Reject, RouterSettings, Wait, route, work_units
from fleet.simulator.events import Event, EventLoop
from fleet.simulator.replica import VirtualReplica
from fleet.simulator.traffic import SimRequest, Traffic, reusable_prefix_tokens
from fleet.telemetry import Telemetry, TrafficMix
from kernels.catalog import get_gpu, get_model
from kernels.config import EngineConfig
from kernels.engine_types import EngineRequest
from kernels.perf import PerfModel
from kernels.tiers import DEFAULT_TIERS, TierSlo, slo_for

KINDS = ("iteration", "arrival", "tick")  # simultaneous events run in this order
_UNMODELLED_MAX_RUNNING = 64  # a pool no plan has sized yet


def classify(spec: SimRequest, rules: ShapeRules) -> str:
    """The simulator's classifier: the shape rules on the true lengths (a perfect output predictor)."""
    return rules.select(spec.tier, spec.domain, spec.tenant, spec.input_tokens, spec.output_tokens)


@dataclass(slots=True)
class Outcomes:
    """Per-request results, index-aligned with the workload's specs (NaN: not reached)."""

    first_at: np.ndarray
    finished_at: np.ndarray
    overhead_s: np.ndarray
    met_slo: np.ndarray
    shed: np.ndarray  # refused with 429 before any token (by the router, or a queue's deadline or bound)
    cached_tokens: np.ndarray  # prompt tokens its engine took from a prefix cache (what a response's usage reports)
    num_dropped: int = 0

    @classmethod
    def empty(cls, num: int) -> Outcomes:
        return cls(np.full(num, np.nan), np.full(num, np.nan), np.zeros(num), np.zeros(num, dtype=bool), np.zeros(num, dtype=bool),
                   np.zeros(num, dtype=np.int64))

    @property
    def num_shed(self) -> int:
        return int(self.shed.sum())


@dataclass(slots=True)
class SimSettings:
    model: str
    tiers: dict[str, TierSlo] = field(default_factory=lambda: dict(DEFAULT_TIERS))
    rules: ShapeRules = field(default_factory=default_shape_rules)
    router: RouterSettings = field(default_factory=RouterSettings)
    tick_s: float = 5.0
    queue_len: int = 1024  # per pool: the bound on requests waiting for room
    # tiers to the router and a queue per pool; False: plain least-load routing straight into the
    # engines' FIFO queues, as deployments without SLO-aware admission run (the round-robin baseline)
    admission: bool = True
    restart_s: Callable[[str, EngineConfig], float] = lambda gpu, config: 0.0


class FleetSim:
    def __init__(self, settings: SimSettings, workload: Traffic, telemetry: Telemetry) -> None:
        self.settings = settings
        self.workload = workload
        self.specs = workload.specs
        self.telemetry = telemetry
        self.shapes = [classify(s, settings.rules) for s in self.specs]
        self.arrivals_s = [s.arrival_s for s in self.specs]
        self.reusable_tokens = reusable_prefix_tokens(self.specs)  # what planning before the run (true_mix) knows of cache hits
        self.outcomes = Outcomes.empty(len(self.specs))
        self.pools: dict[str, PoolState] = {}
        self.pool_to_model: dict[str, PoolModel] = {}  # pool -> the capacity model's view of it, for the router
        self.work = [1.0] * len(self.specs)  # each admitted request's fleet.router.work_units in its pool
        self.slots: dict[str, VirtualReplica] = {}
        self.slot_to_gpu: dict[str, str] = {}
        self.slot_to_config_json: dict[str, str] = {}
        self.loop = EventLoop(KINDS)
        self.loop.on("iteration", self._on_iteration)
        self.loop.on("arrival", self._on_arrival)
        self.on_tick: Callable[[float], None] = lambda now: None
        self.loop.on("tick", self._on_tick)
        self._model = get_model(settings.model)
        self._num_done = 0

    # --- deployment ---------------------------------------------------------------------------------
    def deploy(self, slots: list[SlotState], now: float = 0.0) -> None:
        for slot in slots:
            self.slot_to_gpu[slot.slot] = slot.gpu
            self.start(slot.slot, slot.pool, slot.config_json, now, ready_at=now)
            self.activate(slot.slot, now)

    def slot_states(self, now: float) -> list[SlotState]:
        out = []
        for name, rep in sorted(self.slots.items()):
            out.append(SlotState(name, rep.pool, self.slot_to_gpu[name], self.slot_to_config_json[name],
                                 num_in_flight=rep.num_in_flight, healthy=now >= rep.ready_at))
        return out

    def _pool(self, name: str) -> PoolState:
        pool = self.pools.get(name)
        if pool is None:
            shape = name.split("@", 1)[0]
            shapes = frozenset(self.settings.rules.names) if shape == "all" else frozenset({shape})
            queue = PoolQueue[int](self.settings.queue_len, self.settings.router.shed_retry_after_s) if self.settings.admission else None
            pool = PoolState(name, None, shapes, None, _UNMODELLED_MAX_RUNNING, queue=queue)
            self._model_pool(pool)
            self.pools[name] = pool
        return pool

    # --- Actuator -----------------------------------------------------------------------------------
    def drain(self, slot: str, now: float) -> None:
        """Routable no more; requests still waiting in its engine (no token produced yet) are taken
        back and routed again, as a gateway retries a request that has sent no bytes: a drain then
        waits only for the running batch, not for a queue built up under overload."""
        rep = self.slots[slot]
        rep.state.draining = True
        for req_id in rep.engine.waiting_req_ids():
            index = int(req_id)
            spec = self.specs[index]
            rep.engine.abort(req_id, now)
            del rep.req_to_domain[req_id]
            rep.state.end(spec.input_tokens + spec.output_tokens, self.work[index])
            self._dispatch(index, now)

    def stop(self, slot: str, now: float) -> None:
        """Remove the replica; requests still on it (a drain stopped at its deadline) are dropped."""
        rep = self.slots.pop(slot)
        pool = self.pools[rep.pool]
        if rep.state in pool.replicas:
            pool.replicas.remove(rep.state)
        for req_id in list(rep.req_to_domain):
            rep.engine.abort(req_id, now)
            self._drop(int(req_id))
        rep.req_to_domain.clear()

    def start(self, slot: str, pool: str, config_json: str, now: float, ready_at: float | None = None) -> None:
        gpu = self.slot_to_gpu[slot]
        config = EngineConfig.from_dict(json.loads(config_json))
        self.slot_to_config_json[slot] = config_json
        perf = PerfModel(self._model, get_gpu(gpu), config)
        state = ReplicaState(slot, f"sim://{slot}", pool, CircuitBreaker(3, 5.0), affinity_salt=zlib.crc32(slot.encode()))
        when = now + self.settings.restart_s(gpu, config) if ready_at is None else ready_at
        self.slots[slot] = VirtualReplica(slot, pool, perf, state, when)

    def swap(self, slot: str, pool: str, config_json: str, now: float) -> None:
        """The oracle's move: instant and free. The old engine leaves the router and finishes its
        in-flight requests off the books (its iterations keep running); a new one serves from ``now``."""
        old = self.slots[slot]
        members = self.pools[old.pool].replicas
        if old.state in members:
            members.remove(old.state)
        self.start(slot, pool, config_json, now, ready_at=now)
        self.activate(slot, now)

    def activate(self, slot: str, now: float) -> None:
        rep = self.slots[slot]
        pool = self._pool(rep.pool)
        pool.replicas.append(rep.state)
        self._pump(pool, now)

    def set_pool_model(self, options: Options, mix: TrafficMix) -> None:
        """What the router knows of each pool from the capacity model (``options``, planned for ``mix``)."""
        self.pool_to_model.update(pool_models(options, mix, self.settings.tiers))
        for name in self.pool_to_model:
            if name in self.pools:
                self._model_pool(self.pools[name])

    def _model_pool(self, pool: PoolState) -> None:
        found = self.pool_to_model.get(pool.name)
        if found is None:
            pool.max_running_per_replica = _UNMODELLED_MAX_RUNNING
            return
        found.apply(pool)

    # --- events -------------------------------------------------------------------------------------
    def run(self, end_s: float, grace_s: float = 1800.0) -> None:
        for index, spec in enumerate(self.specs):
            self.loop.push(spec.arrival_s, "arrival", index)
        for k in range(1, int(end_s / self.settings.tick_s) + 1):
            self.loop.push(k * self.settings.tick_s, "tick")
        self.loop.run(end_s)
        self.loop.run(end_s + grace_s, stop=lambda: self._num_done >= len(self.specs))
        for pool in self.pools.values():  # still waiting when the run ends: their deadlines have passed
            while pool.queue is not None and len(pool.queue):
                self._shed(pool.queue.take(math.inf)[1])

    def _on_tick(self, now: float, _: object) -> None:
        self.on_tick(now)
        for pool in list(self.pools.values()):
            if pool.queue is None or not len(pool.queue):
                continue
            self._shed(pool.queue.expire(now))
            if pool.num_routable(now) == 0:  # its replicas moved away: route the waiting requests again
                while True:
                    index, expired = pool.queue.take(now)
                    self._shed(expired)
                    if index is None:
                        break
                    self._dispatch(index, now)
            else:
                self._pump(pool, now)

    def _on_arrival(self, now: float, index: int) -> None:
        spec = self.specs[index]
        self.telemetry.record_arrival(now, self.shapes[index], spec.tier, spec.input_tokens)
        self._dispatch(index, now)

    def _shape(self, index: int) -> Shape:
        spec = self.specs[index]
        prefix_fp = spec.hash_ids[0] if spec.hash_ids else 0
        return Shape(self.shapes[index], spec.domain, 1.0, spec.input_tokens, spec.output_tokens, spec.output_tokens,
                     spec.tier, spec.tenant, prefix_fp, None, True)

    def _dispatch(self, index: int, now: float) -> None:
        """Route a new (or handed-back) request: to a replica, into a pool's queue, or shed."""
        decision = route(self._shape(index), self.settings.model, list(self.pools.values()), now, self.settings.router,
                         tiers=self.settings.tiers if self.settings.admission else None)
        if isinstance(decision, Wait):
            queue = self.pools[decision.pool].queue
            assert queue is not None
            # the wait budget runs from the arrival (a request handed back by a drain has used some)
            deadline = decision.deadline_at - (now - self.specs[index].arrival_s)
            if deadline < now:
                self._shed([Shed(index, "deadline passed", 0.0)])
                return
            shed = queue.offer(index, decision.priority, deadline)
            if shed is not None:
                self._shed([shed])
            return
        if isinstance(decision, Reject):
            if decision.status == 429:
                self._shed([Shed(index, decision.reason, decision.retry_after_s)])
            else:
                self._drop(index)
            return
        self._admit(index, self.slots[decision.replica], now)

    def _admit(self, index: int, rep: VirtualReplica, now: float) -> None:
        spec = self.specs[index]
        req = EngineRequest(str(index), spec.input_tokens, spec.output_tokens, spec.domain, spec.hash_ids, spec.arrival_s)
        if not rep.add(req, now):
            self._drop(index)
            return
        self.work[index] = work_units(self._shape(index), self.pools[rep.pool])
        rep.state.begin(spec.input_tokens + spec.output_tokens, self.work[index])
        self.outcomes.overhead_s[index] = rep.perf.request_overhead_s
        plan = rep.next_plan(now) or rep.cut_for_arrival(now)
        if plan is not None:
            self.loop.push(plan.ended_at, "iteration", (rep, rep.plan_seq))

    def _pump(self, pool: PoolState, now: float) -> None:
        """Admit waiting requests, most urgent first, while a routable replica of ``pool`` has room."""
        if pool.queue is not None:
            pump(pool, pool.queue, now, self.settings.router, self._queued, lambda index, replica: self._place(index, replica, now), self._shed)

    def _queued(self, index: int) -> Queued:
        return Queued(self._shape(index), self.settings.model)

    def _place(self, index: int, replica: ReplicaState | None, now: float) -> None:
        assert replica is not None  # every replica of the simulator serves its one model
        self._admit(index, self.slots[replica.name], now)

    def _drop(self, index: int) -> None:
        self.outcomes.num_dropped += 1
        self._num_done += 1

    def _shed(self, shed: Iterable[Shed[int]]) -> None:
        for item in shed:
            self.outcomes.shed[item.item] = True
            self._num_done += 1

    def _on_iteration(self, now: float, payload: tuple[VirtualReplica, int]) -> Iterable[Event]:
        rep, seq = payload
        if seq != rep.plan_seq or rep.plan is None:
            return ()  # superseded by a cut
        outputs = rep.finish_plan(now)
        out = self.outcomes
        for req_id, num_cached in zip(outputs.first_token_req_ids, outputs.first_token_num_cached, strict=True):
            out.first_at[int(req_id)] = now
            out.cached_tokens[int(req_id)] = num_cached
        for req_id in outputs.finished_req_ids:
            self._finish(int(req_id), rep, now)
        plan = rep.next_plan(now)
        seq = rep.plan_seq
        if outputs.finished_req_ids and rep.state in (pool := self.pools[rep.pool]).replicas:
            self._pump(pool, now)  # an admission here that replaces the plan pushes its own event
        return [(plan.ended_at, "iteration", (rep, seq))] if plan is not None and rep.plan_seq == seq else ()

    def _finish(self, index: int, rep: VirtualReplica, now: float) -> None:
        spec, out = self.specs[index], self.outcomes
        out.finished_at[index] = now
        ttft = out.first_at[index] - spec.arrival_s + out.overhead_s[index]
        tpot = (now - out.first_at[index]) / (spec.output_tokens - 1) if spec.output_tokens > 1 else 0.0
        met = bool(slo_for(self.settings.tiers, spec.tier).met(ttft, tpot))  # numpy floats: a numpy bool otherwise
        out.met_slo[index] = met
        rep.state.end(spec.input_tokens + spec.output_tokens, self.work[index])
        self.telemetry.record_outcome(now, self.shapes[index], rep.pool, met, spec.output_tokens, int(out.cached_tokens[index]), spec.input_tokens)
        self._num_done += 1


def nan_percentile(values: np.ndarray, q: float) -> float:
    finite = values[np.isfinite(values)]
    return float(np.percentile(finite, q)) if finite.size else math.nan
