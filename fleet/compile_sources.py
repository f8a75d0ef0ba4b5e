"""Config sources at the I/O edge: the trial store, and compiles run off the planner's path.

Both implement ``fleet.compiled.ConfigSource`` for one model on ``num_gpus``-GPU replicas:

* ``WorkerConfigSource`` (the live gateway's ``LiveFleet``): a submitted envelope is first looked up in
  the trial store (an artefact of the same shape, model and hardware fingerprints: no search); a miss
  goes to a ``kernels.compiler.CompileWorker`` process, and ``ready`` hands over finished futures.
  SQLite connections do not cross threads, so each lookup opens the store by path (milliseconds).
* ``VirtualTimeConfigSource`` (the simulator): the search runs at once, synchronously and
  deterministically, but its result is released ``trials x s_per_trial`` seconds later on the virtual
  clock, as a worker would deliver it. So a compile neither stalls virtual time nor arrives
  impossibly early, whatever the simulating machine's speed. By default it searches with the
  analytic evaluator (milliseconds a trial, so hour-long simulations stay fast) and charges each trial
  what a performance-model trial costs the live worker (~1.7 CPU s measured on the 2-core dev
  machine); ``fleet.capacity.choose_config`` then judges the result on the planner's queueing-aware
  capacity model before a pool runs it.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Mapping
from dataclasses import dataclass, field

from fleet.compiled import CompiledConfig, Envelope
from kernels.catalog import get_gpu, get_model
from kernels.compiler.evaluators import evaluator_by_name
from kernels.compiler.gates import ParserGate
from kernels.compiler.proposers import CoordinateProposer
from kernels.compiler.search import Budget, CompileResult, compile_config
from kernels.compiler.shape import shape_fingerprint
from kernels.compiler.store import TrialStore, fingerprints_for
from kernels.compiler.worker import CompileRequest, CompileWorker

_Key = tuple[str, Envelope]


@dataclass(frozen=True, slots=True)
class CompileSettings:
    model: str
    num_gpus: int = 1  # GPUs per replica (the planner's pools run one-GPU replicas today)
    evaluator: str = "perf-model"
    budget: Budget = field(default_factory=lambda: Budget(trials=40, seconds=120.0))
    objective: str = "goodput"
    engine_version: str = "unknown"


@dataclass(slots=True)
class _Sources:
    """What both sources share: results known per (GPU kind, envelope), and the outbox ``ready`` empties."""

    settings: CompileSettings
    known: dict[_Key, CompiledConfig] = field(default_factory=dict)
    outbox: list[CompiledConfig] = field(default_factory=list)
    failures: dict[_Key, str] = field(default_factory=dict)  # compiles that raised or found nothing that fits

    def deliver(self, key: _Key, found: CompiledConfig) -> None:
        """A finished compile: known from now on, and reported by the next ``ready``. (A store lookup
        is only known: the plan that asked for it used it at once.)"""
        self.known[key] = found
        self.outbox.append(found)

    def lookup(self, store: TrialStore, gpu: str, envelope: Envelope, shape: str, now: float) -> CompiledConfig | None:
        """A stored artefact for exactly this envelope (warm: a lookup, no search)."""
        s = self.settings
        fingerprints = fingerprints_for(get_model(s.model), get_gpu(gpu), s.num_gpus, s.engine_version, evaluator_by_name(s.evaluator).version)
        stored = store.find_artefact(get_model(s.model).name, get_gpu(gpu).name, s.num_gpus, fingerprints,
                                     shape_fingerprint(envelope.traffic_shape(shape)), s.evaluator, s.objective)
        if stored is None:
            return None
        return CompiledConfig(gpu, envelope, stored.config, stored.metrics.goodput_rps, stored.baseline.goodput_rps,
                              stored.evaluator, 0, stored.warm_start, stored.run_id, _trial_ids(store, stored.run_id, s, gpu),
                              f"found in the trial store: {stored.reason}", now, now)

    def compiled(self, result: CompileResult, store: TrialStore, gpu: str, envelope: Envelope, submitted_at: float,
                 ready_at: float) -> CompiledConfig:
        return CompiledConfig(gpu, envelope, result.config, result.predicted.goodput_rps, result.baseline.goodput_rps,
                              result.evaluator, result.trials, result.warm_start, result.run_id,
                              _trial_ids(store, result.run_id, self.settings, gpu), result.reason, submitted_at, ready_at)

    def take(self) -> list[CompiledConfig]:
        out, self.outbox = self.outbox, []
        return out


def _trial_ids(store: TrialStore, run_id: str, settings: CompileSettings, gpu: str) -> tuple[int, ...]:
    records = store.trials(get_model(settings.model).name, get_gpu(gpu).name, settings.num_gpus, run_id=run_id)
    return tuple(r.trial_id for r in records)


class _Source:
    """What both sources share: compiled results by (GPU kind, envelope), and the store lookup that
    answers an envelope compiled before without a search."""

    state: _Sources
    _pending: Mapping[_Key, object]

    def _collect(self, now: float) -> None:
        raise NotImplementedError

    def best(self, gpu: str, envelope: Envelope, now: float) -> CompiledConfig | None:
        self._collect(now)
        return self.state.known.get((gpu, envelope))

    def ready(self, now: float) -> list[CompiledConfig]:
        self._collect(now)
        return self.state.take()

    def _settled(self, key: _Key) -> bool:
        """Known, being compiled, or failed before: nothing to submit."""
        return key in self.state.known or key in self._pending or key in self.state.failures

    def _found_in(self, store: TrialStore, key: _Key, shape: str, now: float) -> bool:
        found = self.state.lookup(store, key[0], key[1], shape, now)
        if found is not None:
            self.state.known[key] = found
        return found is not None


class WorkerConfigSource(_Source):
    """Live: trial-store lookups, and compiles in a ``CompileWorker`` process (see the module docstring)."""

    def __init__(self, settings: CompileSettings, store_path: str, worker: CompileWorker) -> None:
        self.state = _Sources(settings)
        self.store_path = store_path
        self.worker = worker
        self._pending: dict[_Key, tuple[concurrent.futures.Future[CompileResult | None], float]] = {}

    @classmethod
    def start(cls, settings: CompileSettings, store_path: str) -> WorkerConfigSource:
        """A source with its own worker process (spawned at the first compile); ``close`` ends it."""
        return cls(settings, store_path, CompileWorker())

    def close(self) -> None:
        """End the worker now (a compile in flight is abandoned; the trials it finished are stored)."""
        self.worker.terminate()

    def submit(self, gpu: str, envelope: Envelope, shape: str, now: float) -> None:
        key = (gpu, envelope)
        if self._settled(key):
            return
        with TrialStore(self.store_path) as store:
            if self._found_in(store, key, shape, now):
                return
        s = self.state.settings
        request = CompileRequest(s.model, gpu, s.num_gpus, envelope.traffic_shape(shape), s.objective, s.budget,
                                 self.store_path, s.engine_version, s.evaluator)
        self._pending[key] = (self.worker.submit(request), now)

    def _collect(self, now: float) -> None:
        for key, (future, submitted_at) in list(self._pending.items()):
            if not future.done():
                continue
            del self._pending[key]
            try:
                result = future.result()
            except Exception as exc:  # noqa: BLE001 - whatever broke the worker, the pool stays on the fixed candidates
                self.state.failures[key] = f"compile failed: {exc!r}"
                continue
            if result is None:
                self.state.failures[key] = "no configuration of the search space fits"
                continue
            with TrialStore(self.store_path) as store:
                self.state.deliver(key, self.state.compiled(result, store, key[0], key[1], submitted_at, now))


class VirtualTimeConfigSource(_Source):
    """Simulator: compile at once, release ``trials x s_per_trial`` virtual seconds later (module docstring)."""

    def __init__(self, settings: CompileSettings, store: TrialStore, s_per_trial: float = 1.7) -> None:
        if s_per_trial < 0:
            raise ValueError(f"s_per_trial must be >= 0, got {s_per_trial}")
        self.state = _Sources(settings)
        self.store = store
        self.s_per_trial = s_per_trial
        self._pending: dict[_Key, CompiledConfig] = {}
        self.num_searches = 0

    def at_once(self) -> VirtualTimeConfigSource:
        """A source on the same store whose compiles are ready when submitted: for the plans a policy
        makes before the run (static partitions, adaptive's start) and the oracle's free swaps."""
        return VirtualTimeConfigSource(self.state.settings, self.store, 0.0)

    def submit(self, gpu: str, envelope: Envelope, shape: str, now: float) -> None:
        key = (gpu, envelope)
        if self._settled(key) or self._found_in(self.store, key, shape, now):
            return
        s = self.state.settings
        self.num_searches += 1
        # the deterministic proposer and no parser subprocess: a simulation must not depend on an LLM
        # endpoint or an sglang environment the host happens to have configured
        result = compile_config(s.model, gpu, s.num_gpus, envelope.traffic_shape(shape), s.objective, s.budget, store=self.store,
                                proposer=CoordinateProposer(), evaluator=evaluator_by_name(s.evaluator), parser_gate=ParserGate(),
                                engine_version=s.engine_version)
        if result is None:
            self.state.failures[key] = "no configuration of the search space fits"
            return
        self._pending[key] = self.state.compiled(result, self.store, gpu, envelope, now, now + result.trials * self.s_per_trial)

    def _collect(self, now: float) -> None:
        for key, found in sorted(self._pending.items(), key=lambda item: item[1].ready_at):
            if found.ready_at <= now:
                del self._pending[key]
                self.state.deliver(key, found)
