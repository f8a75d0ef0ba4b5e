"""The controller when the fleet breaks under it: a step whose replica never becomes healthy is rolled
back to the previous plan; so is one whose moved replicas' engines queue what the plan said they run;
slots whose replica is gone leave the GPU budget of the next plan."""

from __future__ import annotations

import dataclasses

import pytest

from fleet.controller import Controller, ControllerSettings
from fleet.decisions import Decision
from fleet.drift import DriftSettings
from fleet.engines.load import EngineLoad
from fleet.evidence import CapacityEvidence, PlanEvidence, RollbackEvidence, VerifyEvidence
from fleet.rollout import SlotState
from fleet.telemetry import Telemetry
from tests.fleet.test_controller_sim import TableCapacity, _feed
from tests.fleet.test_planner_rollout import FakeActuator, tick

GPU = "H100-SXM"
OLD, NEW = f"a@{GPU}", f"b@{GPU}"


def _controller(actuator: FakeActuator, **overrides: object) -> tuple[Controller, Telemetry]:
    tel = Telemetry()
    _feed(tel, 0.0, 200.0, "a", 10.0, True)
    settings = ControllerSettings("llama-3.1-8b", {GPU: 4}, drift=DriftSettings(min_interval_s=0.0), verify_after_s=30.0,
                                  max_step_fraction=0.5, start_timeout_s=60.0, **overrides)  # type: ignore[arg-type]
    controller = Controller(settings, tel, TableCapacity({"a": 5.0, "b": 5.0}), tel.window(200.0))
    _feed(tel, 200.0, 900.0, "b", 10.0, True)  # the mix flips to shape b: the controller wants pools for b
    return controller, tel


def _slots(actuator: FakeActuator, dead: frozenset[str] = frozenset()) -> list[SlotState]:
    """What the actuator reports: each slot where it last became routable (``OLD`` before any move)."""
    return [SlotState(f"G/{k}", actuator.slot_to_pool.get(f"G/{k}", (OLD, "{}"))[0], GPU,
                      actuator.slot_to_pool.get(f"G/{k}", (OLD, "{}"))[1], alive=f"G/{k}" not in dead) for k in range(4)]


def _run(controller: Controller, actuator: FakeActuator, start: int, end: int, dead: frozenset[str] = frozenset()) -> list[Decision]:
    made: list[Decision] = []
    for now in range(start, end, 5):
        made += tick(controller, actuator, float(now), _slots(actuator, dead))
    return made


def test_a_step_whose_replica_never_becomes_healthy_is_rolled_back_to_the_previous_plan() -> None:
    actuator = FakeActuator({}, restart_s=0.0, broken=frozenset({NEW}))  # nothing ever starts healthy in the new pool
    controller, _ = _controller(actuator)
    made = _run(controller, actuator, 205, 400)
    kinds = [d.kind for d in made]
    assert kinds[:3] == ["drift", "plan", "step"] and "rollback" in kinds, kinds
    step, rollback = made[2], made[kinds.index("rollback")]
    evidence = rollback.evidence
    assert isinstance(evidence, RollbackEvidence) and evidence.reason == "replica never became healthy" and evidence.plan_failed is True
    assert sorted(evidence.never_healthy or ()) == sorted(m.slot for m in step.moves)
    assert rollback.at - step.at >= 60.0  # the start deadline, not before
    assert {m.to_pool for m in rollback.moves} == {OLD}
    # back to the previous plan: every slot serves in its old pool with its old configuration, nothing left mid-move
    assert not controller.busy and {pool for pool, _ in (actuator.slot_to_pool[m.slot] for m in step.moves)} == {OLD}
    assert [s.pool for s in _slots(actuator)] == [OLD] * 4
    assert evidence.backoff_s == 300.0 and "plan" not in kinds[3:]  # no new plan during the back-off


def test_lost_slots_leave_the_budget_and_the_next_plan_uses_what_is_left() -> None:
    actuator = FakeActuator({}, restart_s=0.0)
    controller, _ = _controller(actuator, backoff_s=50.0)
    dead = frozenset({"G/2", "G/3"})
    made = _run(controller, actuator, 205, 210, dead)
    # the lost GPUs alone call for a plan (the mix has not been judged drifted yet)
    assert [d.kind for d in made] == ["capacity", "plan", "step"]
    capacity, plan, step = made
    assert capacity.evidence == CapacityEvidence(lost=("G/2", "G/3"), recovered=(), budget={GPU: 2}, reason=capacity.evidence.reason)
    assert isinstance(plan.evidence, PlanEvidence) and plan.evidence.budget == {GPU: 2}
    assert not {m.slot for m in step.moves} & dead  # a dead slot is never moved
    made = _run(controller, actuator, 210, 215)  # they come back
    assert isinstance(made[0].evidence, CapacityEvidence) and made[0].evidence.recovered == ("G/2", "G/3")


def test_a_pool_that_disappears_during_a_repartition_is_rolled_back_and_planned_around() -> None:
    actuator = FakeActuator({}, restart_s=0.0)
    controller, _ = _controller(actuator, backoff_s=50.0)
    now, made = 205, []
    while "step" not in [d.kind for d in made]:
        made += tick(controller, actuator, float(now), _slots(actuator))
        now += 5
    gone = frozenset(m.slot for m in made[-1].moves)
    actuator.broken |= gone  # the hosts of the moving slots vanish mid-step: they never come back up
    made = _run(controller, actuator, now, now + 300, dead=gone)
    kinds = [d.kind for d in made]
    assert kinds[0] == "capacity" and isinstance(made[0].evidence, CapacityEvidence) and made[0].evidence.budget == {GPU: 4 - len(gone)}
    rollbacks = [d for d in made if d.kind == "rollback"]
    assert rollbacks[0].evidence == RollbackEvidence(reason="replica never became healthy", backoff_s=50.0, plan_failed=True,
                                                     never_healthy=tuple(sorted(gone)), start_timeout_s=rollbacks[0].evidence.start_timeout_s)
    assert rollbacks[1].evidence == RollbackEvidence(outcome="failed", reason="the previous configuration never became healthy either")
    replan = next(d for d in made if d.kind == "plan")  # after the back-off: a plan for the GPUs that are left
    assert isinstance(replan.evidence, PlanEvidence) and replan.evidence.budget == {GPU: 4 - len(gone)} and replan.at > rollbacks[0].at


@pytest.mark.parametrize("waiting", [100, 3])
def test_a_step_whose_moved_engines_queue_what_the_plan_said_they_run_is_rolled_back(waiting: int) -> None:
    """The new pool's engines report ``waiting`` requests in their own queue while the gateway holds none
    there: past half the plan's concurrency per replica (TableCapacity: 150) that is a backlog, and the
    step goes back although goodput alone would keep it; a few waiting requests are not."""
    actuator = FakeActuator({}, restart_s=0.0)
    controller, _ = _controller(actuator)
    engine = EngineLoad(scraped_at=0.0, num_running=4, num_waiting=waiting)
    made: list[Decision] = []
    for now in range(205, 400, 5):
        slots = [dataclasses.replace(s, engine=engine) if s.pool == NEW else s for s in _slots(actuator)]
        made += tick(controller, actuator, float(now), slots)
    verify = next(d for d in made if d.kind == "verify")
    assert isinstance(verify.evidence, VerifyEvidence)
    moved = sorted(m.slot for m in next(d for d in made if d.kind == "step").moves)
    assert verify.evidence.engine_waiting == tuple((slot, waiting, 0) for slot in moved)
    if waiting == 3:
        assert verify.evidence.ok is True and verify.evidence.engine_backlogged is None and "rollback" not in [d.kind for d in made]
        return
    assert verify.evidence.ok is False and verify.evidence.engine_backlogged == tuple(moved)
    rollback = next(d for d in made if d.kind == "rollback")
    assert isinstance(rollback.evidence, RollbackEvidence)
    assert rollback.evidence.reason == "the moved replicas' engines queue requests the plan said they run"
    assert {m.to_pool for m in rollback.moves} == {OLD}
