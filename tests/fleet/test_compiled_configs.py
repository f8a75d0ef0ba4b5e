"""Compiled configurations in the fleet: envelopes, the trial-store sources, and the controller adopting
a compile after a drift (kernels.compiler with the analytic evaluator: milliseconds a trial)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from fleet.capacity import CANDIDATE_CONFIGS, Capacity
from fleet.compile_sources import CompileSettings, VirtualTimeConfigSource, WorkerConfigSource
from fleet.compiled import Envelope, envelope_for
from fleet.controller import Controller, ControllerSettings
from fleet.decisions import DecisionLog
from fleet.drift import DriftSettings
from fleet.evidence import CompiledEvidence, CompileEvidence, PlanEvidence
from fleet.options import pool_options
from fleet.rollout import SlotState
from fleet.simulator.run import simulate
from fleet.telemetry import ShapeLoad, Telemetry
from kernels.catalog import get_gpu, get_model
from kernels.compiler import Budget, CompileWorker, TrialStore
from kernels.config import EngineConfig
from kernels.tiers import DEFAULT_TIERS
from loadtest.scenario import build_workload, load_scenario
from tests.fleet.test_controller_sim import TableCapacity
from tests.fleet.test_planner_rollout import FakeActuator, tick

MODEL, GPU = "llama-3.1-8b", "H100-SXM"


class EnvelopeCompiledFaster(TableCapacity):
    """The table's rate, 1.5x for the configuration the source compiled for the load's own envelope
    (the premise of compiling: it is the best for that traffic)."""

    def __init__(self, shape_to_rate: dict[str, float], source: VirtualTimeConfigSource) -> None:
        super().__init__(shape_to_rate)
        self.source = source

    def estimate(self, gpu: str, config: EngineConfig, load, slo) -> Capacity:  # type: ignore[no-untyped-def]
        found = super().estimate(gpu, config, load, slo)
        compiled = self.source.state.known.get((gpu, envelope_for(load, slo, "standard")))
        scale = 1.5 if compiled is not None and compiled.config == config else 1.0
        return Capacity(found.rate_rps * scale, found.concurrency * scale)


class CompiledFaster(TableCapacity):
    """The table's rate for the fixed candidates, 1.5x for anything the compiler found: the planner
    adopts a compile only when its capacity model says it is faster than what a pool runs."""

    def estimate(self, gpu: str, config: EngineConfig, load, slo) -> Capacity:  # type: ignore[no-untyped-def]
        found = super().estimate(gpu, config, load, slo)
        scale = 1.0 if config in CANDIDATE_CONFIGS else 1.5
        return Capacity(found.rate_rps * scale, found.concurrency * scale)
STANDARD = DEFAULT_TIERS["standard"]
SETTINGS = CompileSettings(MODEL, evaluator="analytic", budget=Budget(trials=30))


def _load(prompts: tuple[int, ...], outputs: tuple[int, ...] = (90, 128, 181, 256), rate: float = 4.0) -> ShapeLoad:
    return ShapeLoad("long-context", rate, sum(prompts) / len(prompts), sum(outputs) / len(outputs), (("standard", 1.0),),
                     prompts, outputs)


def test_a_wobble_keeps_the_envelope_and_a_real_change_leaves_it() -> None:
    base = envelope_for(_load((2048, 4096, 6500, 11585)), STANDARD, "standard")
    assert base.prompt_points == (2048, 4096, 5793, 11585)  # the half-octave grid
    wobble = _load((2435, 3444, 6889, 9742), rate=9.0)  # each point a quarter octave off, the rate doubled
    assert envelope_for(wobble, STANDARD, "standard", base) is base
    drifted = envelope_for(_load((4096, 8192, 14000, 23170)), STANDARD, "standard", base)
    assert drifted != base and drifted.prompt_points == (4096, 8192, 16384, 23170)
    tighter = envelope_for(_load((2048, 4096, 6889, 11585)), DEFAULT_TIERS["interactive"], "interactive", base)
    assert tighter != base and tighter.tpot_p99_s == 0.05


def _envelope(prompts: tuple[int, ...]) -> Envelope:
    return envelope_for(_load(prompts), STANDARD, "standard")


def test_virtual_time_release_store_lookup_and_warm_start(tmp_path: Path) -> None:
    with TrialStore(tmp_path / "t.sqlite3") as store:
        source = VirtualTimeConfigSource(SETTINGS, store, s_per_trial=2.0)
        cold_env = _envelope((2048, 4096, 5793, 11585))
        source.submit(GPU, cold_env, "long-context", now=100.0)
        assert source.best(GPU, cold_env, now=100.0) is None  # computed, not yet delivered
        (cold,) = source.ready(now=100.0 + 2.0 * 30)
        assert cold.trials > 5 and not cold.warm_start and cold.ready_at == 100.0 + 2.0 * cold.trials
        assert source.best(GPU, cold_env, now=200.0) is cold and cold.trial_ids
        stored = {r.trial_id for r in store.trials(get_model(MODEL).name, get_gpu(GPU).name, 1)}
        assert set(cold.trial_ids) <= stored

        # the next envelope up (every prompt point one half-octave longer) starts from the stored trials
        near_env = _envelope((2896, 5793, 8192, 16384))
        source.submit(GPU, near_env, "long-context", now=300.0)
        (warm,) = source.ready(now=10_000.0)
        assert warm.warm_start and warm.trials < cold.trials

        # another gateway (source) on the same store: a lookup, no search, ready at once
        other = VirtualTimeConfigSource(SETTINGS, store, s_per_trial=2.0)
        other.submit(GPU, cold_env, "long-context", now=5.0)
        found = other.best(GPU, cold_env, now=5.0)
        assert other.num_searches == 0 and found is not None and found.trials == 0
        assert found.config == cold.config and found.run_id == cold.run_id


def _feed(tel: Telemetry, start: float, end: float, rate: float, prompt: int) -> None:
    k = 0
    while start + k / rate < end:
        at = start + k / rate
        tel.record_arrival(at, "long-context", "standard", prompt)
        tel.record_outcome(at, "long-context", f"long-context@{GPU}", True, 128)
        k += 1


def test_a_drifted_shape_is_compiled_and_the_next_plan_adopts_it(tmp_path: Path) -> None:
    tel = Telemetry()
    _feed(tel, 0.0, 200.0, 4.0, 1000)
    reference = tel.window(200.0)
    settings = ControllerSettings(MODEL, {GPU: 4}, drift=DriftSettings(min_interval_s=0.0), max_step_fraction=1.0)
    with TrialStore(tmp_path / "t.sqlite3") as store:
        source = VirtualTimeConfigSource(SETTINGS, store, s_per_trial=1.0)
        at_once = source.at_once()
        start = pool_options(reference.shapes, (GPU,), EnvelopeCompiledFaster({"long-context": 2.0}, at_once), settings.tiers, at_once)
        capacity = EnvelopeCompiledFaster({"long-context": 2.0}, source)
        actuator = FakeActuator({}, restart_s=0.0)
        controller = Controller(settings, tel, capacity, reference, source)
        controller.options = start
        slots = [SlotState(f"{GPU}/{k}", f"long-context@{GPU}", GPU, start.configs_json()[f"long-context@{GPU}"]) for k in range(4)]
        searches = source.num_searches

        # the rate doubles, the lengths stay: drift and a new plan, but the envelope holds: no compile
        _feed(tel, 200.0, 400.0, 8.0, 1100)
        wobble = [d for now in range(205, 400, 5) for d in tick(controller, actuator, float(now), slots)]
        assert "plan" in [d.kind for d in wobble]
        assert not {"compile", "compiled", "recompile"} & {d.kind for d in wobble} and source.num_searches == searches

        # prompts 8x longer: the shape leaves its envelope, a compile is asked for, the plan meanwhile
        # keeps what it has; when the compile is released the controller plans again with it
        _feed(tel, 400.0, 800.0, 8.0, 8000)
        made = [d for now in range(405, 800, 5) for d in tick(controller, actuator, float(now), slots)]
    kinds = [d.kind for d in made]
    assert kinds.index("drift") < kinds.index("compile") < kinds.index("compiled") < kinds.index("recompile")
    asked = next(d.evidence for d in made if isinstance(d.evidence, CompileEvidence))
    done = next(d.evidence for d in made if isinstance(d.evidence, CompiledEvidence))
    assert asked.pool == f"long-context@{GPU}" and asked.previous_envelope is not None
    assert "left the envelope" in asked.reason and asked.envelope != asked.previous_envelope
    assert done.envelope == asked.envelope and done.trials > 0 and done.trial_ids and done.predicted_gain > 1.0
    assert done.new_config != done.old_config
    plans = [d.evidence for d in made if isinstance(d.evidence, PlanEvidence)]
    assert plans[-1].configs is not None
    adopted = plans[-1].configs[f"long-context@{GPU}"]
    assert json.loads(adopted) == done.new_config
    recompile = next(d for d in made if d.kind == "recompile")
    assert {m.config_json for m in recompile.moves} == {adopted} and len(recompile.moves) == 4


def test_the_live_source_compiles_in_a_worker_process_and_later_looks_up(tmp_path: Path) -> None:
    path = str(tmp_path / "t.sqlite3")
    envelope = _envelope((2048, 4096, 5793, 11585))
    with CompileWorker() as worker:
        source = WorkerConfigSource(SETTINGS, path, worker)
        source.submit(GPU, envelope, "long-context", now=1.0)
        deadline = time.monotonic() + 120.0
        ready: list = []
        while not ready and time.monotonic() < deadline:
            time.sleep(0.2)
            ready = source.ready(now=2.0)
    assert len(ready) == 1 and ready[0].trials > 0 and ready[0].trial_ids and ready[0].submitted_at == 1.0
    again = WorkerConfigSource(SETTINGS, path, CompileWorker())  # never used: the store answers
    again.submit(GPU, envelope, "long-context", now=3.0)
    found = again.best(GPU, envelope, now=3.0)
    again.worker.close()
    assert found is not None and found.trials == 0 and found.config == ready[0].config


def test_closing_the_live_source_kills_a_compile_in_flight(tmp_path: Path) -> None:
    slow = CompileSettings(MODEL, evaluator="perf-model", budget=Budget(trials=60, seconds=600.0))
    source = WorkerConfigSource.start(slow, str(tmp_path / "t.sqlite3"))
    source.submit(GPU, _envelope((2048, 4096, 5793, 11585)), "long-context", now=0.0)
    deadline = time.monotonic() + 60.0
    while not source.worker._pool._processes and time.monotonic() < deadline:  # type: ignore[attr-defined]
        time.sleep(0.05)
    processes = list(source.worker._pool._processes.values())  # type: ignore[attr-defined]
    assert processes and processes[0].is_alive()
    source.close()
    # The executor's manager thread joins the same processes: when it reaps a child first, our
    # is_alive() reads True until that thread records the exit code, a moment later. A compile that
    # was not killed would run for minutes (its budget is 600 s), far past this bound.
    deadline = time.monotonic() + 10.0
    while any(p.is_alive() for p in processes) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(p.is_alive() for p in processes) and source.ready(now=1.0) == []


def test_simulated_adaptive_fleet_runs_compiled_configurations() -> None:
    # 8 req/s: at 4 the starting fleet serves the whole run (its idle pools keep their replicas) and nothing restarts
    workload = build_workload(load_scenario("drift-step"), duration_s=800.0, rate_rps=8.0)
    capacity = CompiledFaster({"short-chat": 3.0, "long-context": 0.6, "reasoning": 1.0, "batch": 1.0})
    log = DecisionLog()
    with TrialStore(":memory:") as store:
        configs = VirtualTimeConfigSource(SETTINGS, store, s_per_trial=1.7)
        result = simulate(workload, "adaptive", {"H100-SXM": 3, "H200": 3}, capacity, log=log, configs=configs)
    assert result.repartitions >= 1 and result.dropped_requests == 0 and result.unfinished_requests == 0
    decisions = log.tail()
    compiled = [e for e in decisions if e["kind"] == "compiled"]
    assert compiled and all(e["evidence"]["trial_ids"] for e in compiled)
    # the replicas restart with what the compiler found (this capacity rates any compile above the fixed candidates)
    last_plan = [e["evidence"] for e in decisions if e["kind"] == "plan"][-1]
    assert any(EngineConfig.from_dict(json.loads(c)) not in CANDIDATE_CONFIGS for c in last_plan["configs"].values())
    assert result.recompiles >= 1


def test_the_gateway_config_turns_compiling_on_with_a_store_path(tmp_path: Path) -> None:
    from gateway.config import load_config
    from tests.support.procs import write_tenant

    pool = {"name": "mixed", "model": MODEL, "gpu": GPU, "shapes": ["short-chat"], "replicas": {"emulated": 1}}
    for controller, expected in (({"enabled": True}, None), ({"enabled": True, "compile_store": "~/c.sqlite3"}, Path.home() / "c.sqlite3")):
        path = tmp_path / "config.yaml"
        (tmp_path / "tenants").mkdir(exist_ok=True)
        write_tenant(tmp_path / "tenants", "t", "sk-compiled-test")
        path.write_text(json.dumps({"tenants_dir": "tenants", "fleet": {"pools": [pool], "controller": controller}}))
        assert load_config(path).controller.compile_store == expected
