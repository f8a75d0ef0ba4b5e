"""A pool whose replicas run a configuration keeps it unless a candidate earns back their restarts."""

from __future__ import annotations

import math

from fleet.capacity import Capacity, PerfCapacity
from fleet.controller import Controller, ControllerSettings
from fleet.decisions import Decision
from fleet.drift import DriftSettings
from fleet.evidence import DriftEvidence, PlanEvidence
from fleet.incumbents import restart_margin, running_configs
from fleet.options import DeclaredPool, config_json, pool_models, pool_options
from fleet.rollout import SlotState
from fleet.telemetry import ShapeLoad, Telemetry, TrafficMix
from kernels.catalog import get_gpu
from kernels.catalog.models import get_model
from kernels.config import EngineConfig
from kernels.engine_servers import LlamacppServer, VllmServer
from kernels.tiers import DEFAULT_TIERS
from tests.fleet.test_declared_pools import _feed, _run
from tests.fleet.test_planner_rollout import FakeActuator, tick

GPU = "H100-SXM"
SMALL_CHUNKS = EngineConfig(chunked_prefill_size=2048)


class DefaultsFaster:
    """sglang's defaults ``gain`` faster than every other configuration (a small chunk size here)."""

    def __init__(self, gain: float) -> None:
        self.gain = gain

    def estimate(self, gpu: str, config: EngineConfig, load: ShapeLoad, slo: object) -> Capacity:
        rate = 10.0 * (1 + self.gain) if config == EngineConfig() else 10.0
        return Capacity(rate, rate * 2)


CHAT = ShapeLoad("chat", 5.0, 800.0, 200.0, (("interactive", 1.0),))


def _config(gain: float, running: dict[str, EngineConfig] | None, margin: float) -> EngineConfig:
    options = pool_options((CHAT,), (GPU,), DefaultsFaster(gain), DEFAULT_TIERS, running=running, restart_margin=margin)
    return dict(options.pool_to_config)["chat@H100-SXM"]


def test_a_running_pool_restarts_only_for_a_gain_that_pays_for_the_restart() -> None:
    margin = restart_margin(48.0, 900.0)  # 20 s drain + 28 s restart out of the 900 s horizon: 5.3%
    running = {"chat@H100-SXM": SMALL_CHUNKS}
    assert _config(0.04, running, margin) == SMALL_CHUNKS  # 4% faster: its replicas would lose more restarting
    assert _config(0.08, running, margin) == EngineConfig()  # 8%: worth the restart
    # no replicas run it (a new pool): nothing restarts, the fastest wins as before
    assert _config(0.04, None, margin) == EngineConfig()
    assert _config(0.04, {"other@H100-SXM": SMALL_CHUNKS}, margin) == EngineConfig()


def test_a_declared_pool_restarts_in_place_only_for_what_a_made_pool_would() -> None:
    declared = (DeclaredPool("chat-h100", GPU, ("chat",), SMALL_CHUNKS, config_json(SMALL_CHUNKS)),)

    def chosen(gain: float, running: dict[str, EngineConfig] | None, margin: float) -> EngineConfig:
        options = pool_options((CHAT,), (GPU,), DefaultsFaster(gain), DEFAULT_TIERS, declared=declared, running=running, restart_margin=margin)
        return dict(options.pool_to_config)["chat-h100"]

    margin = restart_margin(48.0, 900.0)
    running = {"chat-h100": SMALL_CHUNKS}
    assert chosen(0.04, running, margin) == SMALL_CHUNKS and chosen(0.08, running, margin) == EngineConfig()
    assert chosen(1.0, running, math.inf) == SMALL_CHUNKS  # a plan from a short sample restarts none in place
    assert chosen(0.04, None, margin) == EngineConfig()  # no replica runs it: the 2% rule, as before


def test_running_configs_reads_each_pools_single_live_configuration() -> None:
    slots = [
        SlotState("H100-SXM/0", "chat@H100-SXM", GPU, config_json(SMALL_CHUNKS)),
        SlotState("H100-SXM/1", "chat@H100-SXM", GPU, config_json(SMALL_CHUNKS)),
        SlotState("H100-SXM/2", "code@H100-SXM", GPU, config_json(SMALL_CHUNKS)),
        SlotState("H100-SXM/3", "code@H100-SXM", GPU, "{}"),  # mid-rollout: two configurations
        SlotState("H100-SXM/4", "gone@H100-SXM", GPU, "{}", alive=False),
    ]
    assert running_configs(slots) == {"chat@H100-SXM": SMALL_CHUNKS}


def test_an_infinite_margin_keeps_the_incumbent_unless_it_serves_nothing() -> None:
    running = {"chat@H100-SXM": SMALL_CHUNKS}
    assert _config(1.0, running, math.inf) == SMALL_CHUNKS  # twice as fast, still kept
    options = pool_options((CHAT,), (GPU,), ServesOnlyDefaults(), DEFAULT_TIERS, running=running, restart_margin=math.inf)
    assert dict(options.pool_to_config)["chat@H100-SXM"] == EngineConfig()  # the incumbent serves nothing: replaced


class ServesOnlyDefaults:
    def estimate(self, gpu: str, config: EngineConfig, load: ShapeLoad, slo: object) -> Capacity:
        rate = 10.0 if config == EngineConfig() else 0.0
        return Capacity(rate, rate * 2)


class ShapesDefaultsFaster:
    """Per-shape rates; sglang's defaults 50% faster than any other configuration."""

    def estimate(self, gpu: str, config: EngineConfig, load: ShapeLoad, slo: object) -> Capacity:
        rate = {"short-chat": 5.0, "long-context": 1.0}[load.name] * (1.5 if config == EngineConfig() else 1.0)
        return Capacity(rate, rate * 2)


def test_a_drift_plan_from_a_short_sample_moves_replicas_and_its_refine_recompiles() -> None:
    """Long prompts join the chat at t=200: the drift plan (10 s of the new mix) gives them a replica but
    restarts none in place; once the window holds only the new mix the refine plan recompiles the chat
    pool to the faster configuration (50% faster: past the restart margin)."""
    tel = Telemetry()
    _feed(tel, 0.0, 200.0, {"short-chat": 2.0})
    settings = ControllerSettings("llama-3.1-8b", {GPU: 3}, verify_after_s=30.0)
    controller = Controller(settings, tel, ShapesDefaultsFaster(), tel.window(200.0))
    chat = "short-chat@H100-SXM"
    slots = [SlotState(f"{GPU}/{k}", chat, GPU, config_json(SMALL_CHUNKS)) for k in range(3)]
    _feed(tel, 200.0, 500.0, {"short-chat": 2.0, "long-context": 1.0})
    made, slots = _run(controller, FakeActuator({}, restart_s=10.0), slots, 205, 500)
    drift = next(d for d in made if isinstance(d.evidence, DriftEvidence))
    plans = [d for d in made if isinstance(d.evidence, PlanEvidence)]
    assert drift.at - drift.evidence.dwell_since == DriftSettings().strong_dwell_s  # type: ignore[union-attr]
    first, refine = plans[0], plans[1]
    assert first.at == drift.at and first.evidence.trigger is None and first.evidence.outcome == "apply"  # type: ignore[union-attr]
    assert first.evidence.configs is not None and first.evidence.configs[chat] == config_json(SMALL_CHUNKS)  # type: ignore[union-attr]
    assert not [d for d in made if d.kind == "recompile" and d.at < refine.at]
    assert refine.evidence.trigger == "refine" and refine.at >= drift.evidence.dwell_since + tel.window_s  # type: ignore[union-attr]
    recompiled = next(d for d in made if d.kind == "recompile")
    assert recompiled.at == refine.at and {m.to_pool for m in recompiled.moves} == {chat}
    assert {s.config_json for s in slots if s.pool == chat} == {config_json(EngineConfig())}
    assert [s.pool for s in slots].count(f"long-context@{GPU}") >= 1


def _drive(controller: Controller, slots: list[SlotState], tel: Telemetry, phases: list[tuple[float, dict[str, float]]],
           start: int, end: int) -> tuple[list[Decision], list[SlotState]]:
    """Ticks every 5 s, each after its 5 s of traffic (the rate of the latest phase started), as a live edge sees them."""
    actuator, decisions = FakeActuator({}, restart_s=10.0), []
    for now in range(start, end, 5):
        _feed(tel, now - 5.0, float(now), next(rates for at, rates in reversed(phases) if at <= now - 5))
        decisions += tick(controller, actuator, float(now), slots)
        slots = [SlotState(s.slot, pool, s.gpu, config) for s in slots for pool, config in [actuator.slot_to_pool.get(s.slot, (s.pool, s.config_json))]]
    return decisions, slots


def test_a_drift_during_the_refines_rolling_recompiles_cancels_the_rest_and_is_planned_for() -> None:
    """The refine recompiles the chat pool one replica at a time; long prompts triple meanwhile. The drift
    detector keeps watching while only recompiles are left, and its drift ends the rollout after the current
    step: the new plan moves chat replicas to long-context instead of recompiling them first. Without the
    second change every chat replica recompiles and no drift cancels anything."""
    chat, long = "short-chat@H100-SXM", "long-context@H100-SXM"

    def run(phases: list[tuple[float, dict[str, float]]]) -> tuple[list[Decision], list[SlotState]]:
        tel = Telemetry()
        _feed(tel, 0.0, 200.0, {"short-chat": 4.0})
        settings = ControllerSettings("llama-3.1-8b", {GPU: 6}, verify_after_s=60.0)
        controller = Controller(settings, tel, ShapesDefaultsFaster(), tel.window(200.0))
        slots = [SlotState(f"{GPU}/{k}", chat, GPU, config_json(SMALL_CHUNKS)) for k in range(6)]
        return _drive(controller, slots, tel, phases, 205, 900)

    settled, settled_slots = run([(200.0, {"short-chat": 4.0, "long-context": 1.0})])
    refine = next(d for d in settled if isinstance(d.evidence, PlanEvidence) and d.evidence.trigger == "refine")
    recompiled = next(d for d in settled if d.kind == "recompile")
    assert recompiled.at == refine.at and len(recompiled.moves) >= 3
    steps = [d for d in settled if d.kind == "step" and d.at >= refine.at]
    assert len(steps) == len(recompiled.moves)  # one replica of the pool per step, every one of them
    assert not [d for d in settled if isinstance(d.evidence, DriftEvidence) and d.evidence.tuning_dropped]

    moved, slots = run([(200.0, {"short-chat": 4.0, "long-context": 1.0}), (400.0, {"short-chat": 4.0, "long-context": 3.0})])
    refine = next(d for d in moved if isinstance(d.evidence, PlanEvidence) and d.evidence.trigger == "refine")
    assert len(next(d for d in moved if d.kind == "recompile").moves) == len(recompiled.moves)  # the same refine
    cancelled = next(d for d in moved if isinstance(d.evidence, DriftEvidence) and d.at > refine.at)
    assert cancelled.evidence.tuning_dropped  # type: ignore[union-attr]
    last_step = max(d.at for d in moved if d.kind == "step" and refine.at <= d.at < cancelled.at)
    assert next(d for d in moved if d.kind == "verify" and d.at > last_step).at == cancelled.at  # after its step, not during it
    plan_after = next(d for d in moved if isinstance(d.evidence, PlanEvidence) and d.at == cancelled.at)
    assert plan_after.evidence.diff is not None and plan_after.evidence.diff[long][1] > plan_after.evidence.diff[long][0]  # type: ignore[union-attr]
    steps_before = [d for d in moved if d.kind == "step" and refine.at <= d.at < cancelled.at]
    assert len(steps_before) < len(recompiled.moves)
    assert [s.pool for s in slots].count(long) > [s.pool for s in settled_slots].count(long)


def test_a_made_pool_whose_shape_went_quiet_keeps_its_replica_until_another_pool_gains_by_it() -> None:
    """Long prompts stop at t=200 while the chat pool serves its demand with room to spare: the drift's plans
    keep the long-context replica where it is (moving it would gain nothing). When the chat demand then
    outgrows its pool, the idle replica is the one that moves. Before, every plan without long-context load
    moved it to the chat pool at once (the planner had no option for it, and filled the idle GPU)."""
    chat, long = "short-chat@H100-SXM", "long-context@H100-SXM"
    tel = Telemetry()
    _feed(tel, 0.0, 200.0, {"short-chat": 4.0, "long-context": 0.5})
    settings = ControllerSettings("llama-3.1-8b", {GPU: 3}, verify_after_s=30.0)
    controller = Controller(settings, tel, ShapesDefaultsFaster(), tel.window(200.0))
    slots = [SlotState(f"{GPU}/0", chat, GPU, "{}"), SlotState(f"{GPU}/1", chat, GPU, "{}"), SlotState(f"{GPU}/2", long, GPU, "{}")]
    quiet, slots = _drive(controller, slots, tel, [(200.0, {"short-chat": 4.0})], 205, 700)
    assert [d for d in quiet if isinstance(d.evidence, DriftEvidence)]  # the mix did change
    assert not [d for d in quiet if d.kind == "step"] and [s.pool for s in slots].count(long) == 1
    busy, slots = _drive(controller, slots, tel, [(700.0, {"short-chat": 20.0})], 705, 1200)
    assert [s.pool for s in slots] == [chat, chat, chat]
    moved = next(d for d in busy if d.kind == "step")
    assert [(m.slot, m.from_pool, m.to_pool) for m in moved.moves] == [(f"{GPU}/2", long, chat)]


def test_each_pool_model_carries_the_tpot_its_shapes_strictest_tier_sized_it_for() -> None:
    # the router lets a tighter tier count on only part of a pool sized for a looser TPOT (fleet.router_steps)
    code = ShapeLoad("code", 3.0, 1500.0, 900.0, (("standard", 1.0),))
    mixed = (DeclaredPool("shared", GPU, ("chat", "code"), EngineConfig(), config_json(EngineConfig())),)
    loads = (CHAT, code)
    made = pool_models(pool_options(loads, (GPU,), DefaultsFaster(0.0), DEFAULT_TIERS), TrafficMix(0.0, 60.0, loads), DEFAULT_TIERS)
    assert made["chat@H100-SXM"].tpot_objective_s == DEFAULT_TIERS["interactive"].tpot_p99_s
    assert made["code@H100-SXM"].tpot_objective_s == DEFAULT_TIERS["standard"].tpot_p99_s
    shared = pool_models(pool_options(loads, (GPU,), DefaultsFaster(0.0), DEFAULT_TIERS, declared=mixed), TrafficMix(0.0, 60.0, loads),
                         DEFAULT_TIERS)
    assert shared["shared"].tpot_objective_s == DEFAULT_TIERS["interactive"].tpot_p99_s  # its chats set it


def test_a_declared_llamacpp_pool_judges_each_candidate_as_llama_server_runs_it() -> None:
    """A llama.cpp pool of one slot serving 1,080-token prompts on a CPU slot: judged as sglang would run
    them, llama-server's defaults (a candidate that leaves its slots and KV pool unset) look 1.7x faster and
    the pool restarts with them; llama-server then runs 4 slots in the model's 2,048-token context, where
    two such prompts do not fit at once (tests/gateway/test_real_drift.py: 43 streams ended in "Context
    size has been exceeded"). Judged as it runs, the declared configuration stays."""
    long = ShapeLoad("long-context", 3.5, 1086.0, 96.0, (("standard", 1.0),))
    one_slot = EngineConfig(max_running_requests=1)

    def chosen(llamacpp: LlamacppServer | None) -> tuple[EngineConfig, float]:
        declared = (DeclaredPool("long-cpu", "cpu", ("long-context",), one_slot, config_json(one_slot), llamacpp),)
        options = pool_options((long,), ("cpu",), PerfCapacity("tiny-llama"), DEFAULT_TIERS, declared=declared,
                               running={"long-cpu": one_slot}, restart_margin=restart_margin(48.0, 900.0))
        return dict(options.pool_to_config)["long-cpu"], options.pools[0].serves[0].rate_per_replica_rps

    as_sglang, sglang_rate = chosen(None)
    assert as_sglang == EngineConfig() and sglang_rate > 2.0  # 2.37 req/s
    as_run, rate = chosen(LlamacppServer(get_model("tiny-llama").max_context))
    assert as_run == one_slot and rate < 1.5  # 1.16 req/s


def test_a_declared_vllm_pool_judges_each_candidate_as_vllm_runs_it_on_its_gpu() -> None:
    """A vLLM pool of Llama 3.1 8B on an A100 whose replicas run vLLM's defaults. vLLM batches 2,048
    tokens a step there, where sglang chunks 8,192 (kernels.engine_servers). Judged as sglang, the pool
    is restarted for a 2,048-token chunk that it already runs on 6,000-token prompts, and on 3,000-token
    interactive ones it keeps the defaults, which vLLM runs 8% slower than an 8,192-token batch."""
    a100, capacity = "A100-80GB", PerfCapacity("llama-3.1-8b")

    def chosen(load: ShapeLoad, engine: VllmServer | None) -> EngineConfig:
        declared = (DeclaredPool("long-a100", a100, ("long-context",), EngineConfig(), config_json(EngineConfig()), engine),)
        options = pool_options((load,), (a100,), capacity, DEFAULT_TIERS, declared=declared,
                               running={"long-a100": EngineConfig()}, restart_margin=restart_margin(48.0, 900.0))
        return dict(options.pool_to_config)["long-a100"]

    vllm = VllmServer(get_gpu(a100))
    standard = ShapeLoad("long-context", 3.5, 6000.0, 200.0, (("standard", 1.0),))
    assert chosen(standard, None) == SMALL_CHUNKS and chosen(standard, vllm) == EngineConfig()  # no restart for nothing
    interactive = ShapeLoad("long-context", 3.5, 3000.0, 200.0, (("interactive", 1.0),))
    assert chosen(interactive, None) == EngineConfig() and chosen(interactive, vllm) == EngineConfig(chunked_prefill_size=8192)


def test_a_pool_made_on_a_llamacpp_gpu_runs_as_many_slots_as_hold_its_longest_requests() -> None:
    """The controller makes ``long-context@cpu`` where only a chat pool is declared on a llama.cpp CPU fleet;
    gateway.replicas launches it with that pool's engine, llama-server. No fixed candidate sets a slot
    count, and llama-server runs an unset one as 4 slots sharing the model's 2,048 tokens, where two
    1,182-token requests already overflow: judged as sglang, a candidate that leaves them unset is chosen.
    Judged as llama-server runs it, the pool gets the one slot that holds them; a declared pool whose
    own configuration cannot hold its requests is given the same."""
    long = ShapeLoad("long-context", 3.5, 1086.0, 96.0, (("standard", 1.0),))
    chat = DeclaredPool("chat-cpu", "cpu", ("short-chat",), EngineConfig(), config_json(EngineConfig()), LlamacppServer(2048))
    capacity = PerfCapacity("tiny-llama")

    def made(llamacpp: dict[str, LlamacppServer]) -> EngineConfig:
        options = pool_options((long,), ("cpu",), capacity, DEFAULT_TIERS, declared=(chat,), made_engines=llamacpp)
        return dict(options.pool_to_config)["long-context@cpu"]

    assert made({}).max_running_requests is None  # sglang would size it from memory; llama-server runs 4
    assert made({"cpu": LlamacppServer(2048)}) == EngineConfig(max_running_requests=1)
    unset = DeclaredPool("long-cpu", "cpu", ("long-context",), EngineConfig(), config_json(EngineConfig()), LlamacppServer(2048))
    options = pool_options((long,), ("cpu",), capacity, DEFAULT_TIERS, declared=(unset,))
    assert dict(options.pool_to_config)["long-cpu"] == EngineConfig(max_running_requests=1)
