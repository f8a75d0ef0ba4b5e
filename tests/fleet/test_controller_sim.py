"""Controller (drift -> plan -> step -> verify -> rollback) and the virtual-time simulator end to end."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest

from fleet.capacity import Capacity
from fleet.controller import Controller, ControllerSettings
from fleet.drift import DriftSettings
from fleet.evidence import PlanEvidence, RollbackEvidence, VerifyEvidence
from fleet.rollout import SlotState
from fleet.simulator.events import EventLoop
from fleet.simulator.run import simulate
from fleet.telemetry import Telemetry
from kernels.config import EngineConfig
from loadtest.scenario import build_workload, load_scenario
from tests.fleet.test_planner_rollout import FakeActuator, tick


class TableCapacity:
    """Capacity per shape from a table: fast, and exact for the tests. Its concurrency (the router's
    saturation limit) allows 30 s per request in flight, more than any test request takes, so the
    table's rates, not the admission limit, decide what a pool serves."""

    def __init__(self, shape_to_rate: dict[str, float]) -> None:
        self.shape_to_rate = shape_to_rate

    def estimate(self, gpu: str, config: EngineConfig, load, slo) -> Capacity:  # type: ignore[no-untyped-def]
        rate = self.shape_to_rate.get(load.name, 1.0)
        return Capacity(rate, rate * 30.0)


def test_event_loop_orders_same_instant_by_kind_then_seq() -> None:
    seen: list[str] = []
    loop = EventLoop(("iteration", "arrival", "tick"))
    for kind in ("tick", "arrival", "iteration"):
        loop.on(kind, lambda now, payload, kind=kind: seen.append(f"{kind}{payload}"))
    loop.push(1.0, "tick", 1)
    loop.push(1.0, "arrival", 1)
    loop.push(1.0, "arrival", 2)
    loop.push(1.0, "iteration", 1)
    loop.push(0.5, "tick", 0)
    loop.run(2.0)
    assert seen == ["tick0", "iteration1", "arrival1", "arrival2", "tick1"]


def _feed(tel: Telemetry, start: float, end: float, shape: str, rate: float, met: bool | float) -> None:
    """``rate`` requests a second of ``shape``; ``met``: whether each met its SLO, or the share that did (spread evenly)."""
    share = float(met)
    k = 0
    while start + k / rate < end:
        at = start + k / rate
        tel.record_arrival(at, shape, "standard", 1000)
        tel.record_outcome(at, shape, f"{shape}@H100-SXM", math.floor((k + 1) * share) > math.floor(k * share), 100)
        k += 1


@pytest.mark.parametrize("met_after", [0.0, 0.6, 0.8])
def test_a_step_that_makes_things_worse_is_rolled_back_with_backoff(met_after: float) -> None:
    """10 req/s all met before the step, ``met_after`` of them after: the floor is 0.85 x 10 = 8.5 req/s
    and a 30 s window's counting noise 1.06 req/s (fleet.controller.counting_noise_rps), so 8 req/s is
    within it and the step stays, while 6 and 0 are rolled back."""
    tel = Telemetry()
    _feed(tel, 0.0, 200.0, "a", 10.0, True)
    reference = tel.window(200.0)
    settings = ControllerSettings("llama-3.1-8b", {"H100-SXM": 4}, drift=DriftSettings(min_interval_s=0.0), verify_after_s=30.0,
                                  max_step_fraction=0.5)
    actuator = FakeActuator({}, restart_s=0.0)
    controller = Controller(settings, tel, TableCapacity({"a": 5.0, "b": 5.0}), reference)
    slots = [SlotState(f"G/{k}", "a@H100-SXM", "H100-SXM", "{}") for k in range(4)]
    _feed(tel, 200.0, 250.0, "b", 10.0, True)  # the mix flips to shape b
    kinds: list[str] = []
    for now in range(205, 250, 5):
        made = tick(controller, actuator, float(now), slots)
        kinds += [d.kind for d in made]
        if "step" in kinds:
            moved = {m.slot: m.to_pool for d in made for m in d.moves if d.kind == "step"}
            slots = [SlotState(s.slot, moved.get(s.slot, s.pool), s.gpu, s.config_json) for s in slots]
            break
    assert kinds[:3] == ["drift", "plan", "step"] and controller.busy
    step_at = float(now)
    _feed(tel, 250.0, 400.0, "b", 10.0, met_after)
    decisions = []
    for later in range(int(step_at) + 5, int(step_at) + 90, 5):
        decisions += tick(controller, actuator, float(later), slots)
    verify = decisions[0]
    assert isinstance(verify.evidence, VerifyEvidence) and verify.evidence.noise_rps == pytest.approx(1.065, abs=0.01)
    assert verify.evidence.observed_goodput_rps == pytest.approx(10 * met_after, abs=0.1)
    if met_after == 0.8:
        assert verify.evidence.ok is True and "rollback" not in [d.kind for d in decisions], decisions
        return
    assert [d.kind for d in decisions] == ["verify", "rollback"]
    rollback = decisions[1]
    assert verify.evidence.ok is False
    assert all(m.to_pool.startswith("a@") for m in rollback.moves) and rollback.evidence == RollbackEvidence(
        reason="observed goodput below prediction and below the goodput before the step", backoff_s=300.0, plan_failed=True)


def test_simulator_adaptive_repartitions_without_dropping_requests() -> None:
    workload = build_workload(load_scenario("drift-step"), duration_s=400.0, rate_rps=4.0)
    capacity = TableCapacity({"short-chat": 3.0, "long-context": 0.6, "reasoning": 1.0, "batch": 1.0})
    result = simulate(workload, "adaptive", {"H100-SXM": 3, "H200": 3}, capacity)
    assert result.repartitions >= 1
    assert result.dropped_requests == 0 and result.unfinished_requests == 0
    assert result.num_requests == len(workload.specs) and 0 < result.slo_attainment <= 1


def test_simulator_is_deterministic_and_policies_share_the_workload() -> None:
    workload = build_workload(load_scenario("stationary"), duration_s=120.0, rate_rps=3.0)
    capacity = TableCapacity({"short-chat": 3.0, "long-context": 0.6, "reasoning": 1.0, "batch": 1.0})
    first = simulate(workload, "static-initial", {"H100-SXM": 2}, capacity)
    again = simulate(workload, "static-initial", {"H100-SXM": 2}, capacity)
    rr = simulate(workload, "round-robin", {"H100-SXM": 2}, capacity)
    assert first.goodput_rps == again.goodput_rps and first.ttft_p99_s == again.ttft_p99_s
    assert rr.num_requests == first.num_requests and rr.dropped_requests == 0


def test_oracle_swaps_lose_no_request_and_no_goodput() -> None:
    # An amply provisioned fleet: every plan serves everything, so the oracle's per-minute swaps (the
    # old engine finishes off the books) must match the static policies request for request.
    workload = build_workload(load_scenario("drift-step"), duration_s=480.0, rate_rps=6.0)
    capacity = TableCapacity({"short-chat": 4.0, "long-context": 0.5, "reasoning": 0.8, "batch": 1.0})
    budget = {"H100-SXM": 6}
    oracle = simulate(workload, "oracle", budget, capacity)
    assert oracle.repartitions >= 3 and oracle.unfinished_requests == 0 and oracle.dropped_requests == 0
    for policy in ("static-initial", "static-hindsight"):
        assert oracle.goodput_rps >= simulate(workload, policy, budget, capacity).goodput_rps


def test_the_oracle_sizes_pools_from_the_phase_it_plans_in() -> None:
    from fleet.simulator.policies import profile_span_s

    assert profile_span_s(60.0, ()) == (0.0, 240.0)  # 5 minutes around the window, from the run's start
    assert profile_span_s(240.0, (400.0,)) == (120.0, 400.0)  # not into the burst that starts at 400 s
    assert profile_span_s(600.0, (600.0,)) == (600.0, 780.0)  # a plan at the change reads the new mix only
    assert profile_span_s(660.0, (300.0, 600.0)) == (600.0, 840.0)


def test_simulator_takes_plain_request_objects_and_keeps_the_json_keys() -> None:
    from fleet.simulator.traffic import SimTraffic

    @dataclass(frozen=True)
    class Req:
        arrival_s: float
        input_tokens: int = 300
        output_tokens: int = 50
        domain: str = "chat"
        tenant: str = "t"
        tier: str = "interactive"
        hash_ids: tuple[int, ...] = ()

    traffic = SimTraffic("plain", [Req(k * 0.5) for k in range(60)], 30.0)
    result = simulate(traffic, "round-robin", {"H100-SXM": 1}, TableCapacity({}))
    keys = {"goodput_rps", "slo_attainment", "throughput_tokens_s", "ttft_p99_s", "tpot_p99_s", "repartitions", "recompiles", "dropped_requests"}
    assert keys <= set(result.to_json()) and result.num_requests == 60 and result.dropped_requests == 0


def test_overload_sheds_batch_while_interactive_meets_its_slo() -> None:
    # one replica, batch arriving at several times what it serves: straight into the engine (no
    # admission) every request joins its FIFO and the interactive ones miss; with the pool queue they
    # go first, batch waits its budget and the excess is shed with 429 (not dropped, no GPU time)
    import numpy as np

    from fleet.rollout import SlotState
    from fleet.simulator.traffic import SimTraffic
    from fleet.simulator.world import FleetSim, SimSettings

    @dataclass(frozen=True)
    class Req:
        arrival_s: float
        tier: str
        input_tokens: int = 300
        output_tokens: int = 100
        domain: str = "chat"
        tenant: str = "t"
        hash_ids: tuple[int, ...] = ()

    specs = sorted([Req(k / 120.0, "batch") for k in range(120 * 30)] + [Req(0.013 + k / 5.0, "interactive", output_tokens=40) for k in range(5 * 30)],
                   key=lambda r: r.arrival_s)
    tiers = np.array([r.tier for r in specs])
    inter, batch = tiers == "interactive", tiers == "batch"
    outcomes = {}
    for admission in (True, False):
        sim = FleetSim(SimSettings("llama-3.1-8b", admission=admission), SimTraffic("overload", specs, 30.0), Telemetry())
        sim.deploy([SlotState("H100-SXM/0", "all", "H100-SXM", "{}")])
        sim.run(30.0)
        outcomes[admission] = out = sim.outcomes
        assert out.num_dropped == 0 and not (out.met_slo & out.shed).any() and np.isfinite(out.finished_at[~out.shed]).all()
    out = outcomes[True]
    assert not out.shed[inter].any() and out.met_slo[inter].mean() >= 0.95
    assert out.shed[batch].mean() > 0.3 and out.met_slo[batch].sum() > 0  # batch served up to what is left, the rest shed
    assert outcomes[False].num_shed == 0 and outcomes[False].met_slo[inter].mean() < 0.5  # FIFO behind the batch backlog


def test_engine_cut_ends_a_fast_forwarded_stretch_at_the_next_step_boundary() -> None:
    from kernels.engine_types import EngineRequest
    from tests.kernels.engine_helpers import TablePerf, make_engine

    perf = TablePerf(kv_capacity_tokens=50_000)
    whole, cut = make_engine(perf, page_size=16), make_engine(perf, page_size=16)
    for engine in (whole, cut):
        for k in range(3):
            engine.add_request(EngineRequest(f"r{k}", 64, 200 + k), 0.0)
        first = engine.schedule(0.0)
        assert first is not None
        engine.update(first, first.ended_at)
    start = first.ended_at
    stretch = whole.schedule(start, horizon_s=1e9)
    plan = cut.schedule(start, horizon_s=1e9)
    assert stretch is not None and plan is not None and stretch.num_steps > 10
    at = start + stretch.duration_s / 3
    shorter = cut.cut(plan, at)
    assert 1 <= shorter.num_steps < stretch.num_steps and shorter.ended_at >= at
    assert perf.decode_run_time_s(3, plan.shape.sum_decode_context, shorter.num_steps - 1) < at - start  # the first boundary at or after
    assert cut.cut(shorter, shorter.ended_at) is shorter  # nothing left to cut
    outputs = cut.update(shorter, shorter.ended_at)
    assert set(outputs.num_new_tokens) == {shorter.num_steps}
    rest = cut.schedule(shorter.ended_at, horizon_s=1e9)
    assert rest is not None and rest.ended_at == pytest.approx(stretch.ended_at, rel=1e-9)  # the same finish as uncut


@pytest.mark.parametrize(("span_s", "b_replicas"), [(30.0, 2), (math.inf, 1)])
def test_a_burst_in_the_sample_earns_its_shape_capacity_the_mean_would_not(span_s: float, b_replicas: int) -> None:
    """Shape a steady at 10 req/s, shape b 40 req/s for 30 s of the 115 s sample (10.4 on average), 10 req/s
    per replica of either. One of four GPUs dies and the controller plans the three left. By the mean one
    replica of each serves everything and the spare one stays in a. By 30 s spans b's burst span is
    served 20 instead of 10 req/s by a second replica, more than a's spare serves (nothing)."""
    tel = Telemetry()
    _feed(tel, 0.0, 240.0, "a", 10.0, True)
    _feed(tel, 150.0, 180.0, "b", 40.0, True)
    settings = ControllerSettings("llama-3.1-8b", {"H100-SXM": 4}, plan_span_s=span_s)
    controller = Controller(settings, tel, TableCapacity({"a": 10.0, "b": 10.0}), tel.window(240.0))
    slots = [SlotState(f"G/{k}", pool, "H100-SXM", "{}", alive=k != 3)
             for k, pool in enumerate(("a@H100-SXM", "a@H100-SXM", "b@H100-SXM", "b@H100-SXM"))]
    made = controller.tick(240.0, slots).decisions
    (planned,) = [d.evidence for d in made if isinstance(d.evidence, PlanEvidence)]
    after = {pool: counts[1] for pool, counts in (planned.diff or {}).items()}
    assert [d.kind for d in made][0] == "capacity"
    assert after.get("b@H100-SXM", 1) == b_replicas and after.get("a@H100-SXM", 2) == 3 - b_replicas, planned


@pytest.mark.parametrize(("a_rps", "applied"), [(10.65, False), (11.5, True)])
def test_a_plan_whose_gain_is_within_the_samples_counting_noise_keeps_the_fleet(a_rps: float, applied: bool) -> None:
    """Shapes a at ``a_rps`` and b at 5 req/s, 10 req/s per replica; one a and three b replicas are left
    when a GPU dies. Moving a b replica to a gains min(a_rps, 20) - 10 req/s. The move cost alone
    declines gains under about 0.47 req/s; the 115 s sample's counting noise at the 15 req/s served now
    is 0.72 req/s (fleet.controller.counting_noise_rps), so a 0.65 req/s gain keeps the fleet and says
    why, while 1.5 req/s moves the replica."""
    tel = Telemetry()
    _feed(tel, 0.0, 240.0, "a", a_rps, True)
    _feed(tel, 120.0, 240.0, "b", 5.0, True)
    settings = ControllerSettings("llama-3.1-8b", {"H100-SXM": 5})
    controller = Controller(settings, tel, TableCapacity({"a": 10.0, "b": 10.0}), tel.window(240.0))
    slots = [SlotState(f"G/{k}", pool, "H100-SXM", "{}", alive=k != 4)
             for k, pool in enumerate(("a@H100-SXM", *["b@H100-SXM"] * 4))]
    made = controller.tick(240.0, slots)
    (planned,) = [d.evidence for d in made.decisions if isinstance(d.evidence, PlanEvidence)]
    change = {"a@H100-SXM": (1, 2), "b@H100-SXM": (3, 2)}
    gain = planned.predicted_goodput_after_rps - planned.predicted_goodput_before_rps  # type: ignore[operator]
    assert gain == pytest.approx(min(a_rps, 20.0) - 10.0, abs=0.01)
    if applied:
        assert planned.outcome == "apply" and planned.diff == change and planned.declined is None and made.commands
    else:
        assert planned.outcome == "keep" and not planned.diff and planned.declined == change and not made.commands
        assert planned.noise_rps == pytest.approx(0.72, abs=0.01)
