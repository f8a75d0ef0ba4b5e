"""The controller's plan counts the engines' foreign load: requests an engine holds beyond the gateway's
own take a share of its replicas' capacity, and the planner credits each replica only with the rest."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from fleet.controller import Controller, ControllerSettings
from fleet.decisions import Decision, DecisionLog, read_decision
from fleet.drift import DriftSettings
from fleet.engines.load import EngineLoad
from fleet.evidence import PlanEvidence, from_json
from fleet.foreign_load import MIN_LEFT_SHARE, ForeignLoad, discounted, foreign_shares
from fleet.options import Options
from fleet.planner import PoolOption, ShapeRate
from fleet.rollout import SlotState
from fleet.telemetry import Telemetry
from tests.fleet.test_controller_sim import TableCapacity, _feed
from tests.fleet.test_planner_rollout import FakeActuator, tick

GPU = "H100-SXM"
A, B = f"a@{GPU}", f"b@{GPU}"
OWN_IN_FLIGHT = 5  # the gateway's requests on each replica; the engine's figures count them too


def _first_plan(engine: EngineLoad | None) -> PlanEvidence:
    """Four replicas serve shape a (10 req/s, 5 req/s per replica in TableCapacity, concurrency 150);
    the mix becomes a at 12 req/s and b at 2 req/s. Each of a's engines reports ``engine``."""
    tel = Telemetry()
    _feed(tel, 0.0, 200.0, "a", 10.0, True)
    settings = ControllerSettings("llama-3.1-8b", {GPU: 4}, drift=DriftSettings(min_interval_s=0.0))
    controller = Controller(settings, tel, TableCapacity({"a": 5.0, "b": 5.0}), tel.window(200.0))
    for start in range(200, 600, 5):  # bucket by bucket: the telemetry ring takes records in time order
        _feed(tel, float(start), start + 5.0, "a", 12.0, True)
        _feed(tel, float(start), start + 5.0, "b", 2.0, True)
    actuator = FakeActuator({f"G/{k}": OWN_IN_FLIGHT for k in range(4)}, restart_s=0.0)
    slots = [SlotState(f"G/{k}", A, GPU, "{}", engine=engine) for k in range(4)]
    for now in range(205, 600, 5):
        made: list[Decision] = tick(controller, actuator, float(now), slots)
        plans = [d.evidence for d in made if isinstance(d.evidence, PlanEvidence)]
        if plans:
            return plans[0]
    raise AssertionError("no plan")


@pytest.mark.parametrize("engine", [None, EngineLoad(scraped_at=0.0, num_running=OWN_IN_FLIGHT, num_waiting=0)],
                         ids=["no-figures", "no-foreign-load"])
def test_without_foreign_load_the_plan_is_todays(engine: EngineLoad | None) -> None:
    """No engine figures, or figures that hold only the gateway's own requests: a's fourth replica moves
    to b (a needs 12 / 5 = 2.4 replicas), and the evidence has no foreign_share key."""
    evidence = _first_plan(engine)
    assert evidence.outcome == "apply" and evidence.diff == {A: (4, 3), B: (0, 1)}
    assert evidence.foreign_share is None and "foreign_share" not in evidence.to_json()


def test_foreign_load_on_a_pools_engines_keeps_the_replicas_a_plan_without_it_takes_away() -> None:
    """Each of a's engines runs 80 requests, 75 of them not the gateway's: half the plan's concurrency of
    150 per replica. a's replicas are credited 2.5 req/s, so four of them serve 10 of a's 12 req/s, and
    moving one to b (2 req/s) would lose more of a than it gains: the plan keeps all four in a."""
    evidence = _first_plan(EngineLoad(scraped_at=0.0, num_running=80, num_waiting=0))
    assert evidence.outcome == "keep" and evidence.diff == {}
    assert evidence.foreign_share == {A: 0.5}
    logged = evidence.to_json()
    assert logged["foreign_share"] == {A: 0.5} and from_json("plan", logged) == evidence


def test_foreign_load_that_grows_under_a_steady_mix_calls_for_a_plan_that_gives_its_pool_a_replica() -> None:
    """The mix stays a at 12 req/s and b at 2 req/s after the first plan (a: 3 replicas, b: 1). From t=500
    a's engines hold 75 foreign requests each. The window mean rises past ``foreign_replan_change`` (0.2)
    and a plan follows with no drift: a's replicas at 0.2 of their capacity still cover a, so it keeps;
    once the share has risen by another 0.2 (toward 0.5), another plan follows and b's replica moves to a
    (a's replicas at ~0.6 of 5 req/s: three serve 9 of a's 12 req/s, four 12; b's 2 req/s are worth less)."""
    tel = Telemetry()
    _feed(tel, 0.0, 200.0, "a", 10.0, True)
    settings = ControllerSettings("llama-3.1-8b", {GPU: 4}, drift=DriftSettings(min_interval_s=0.0), verify_after_s=30.0)
    controller = Controller(settings, tel, TableCapacity({"a": 5.0, "b": 5.0}), tel.window(200.0))
    for start in range(200, 1000, 5):
        _feed(tel, float(start), start + 5.0, "a", 12.0, True)
        _feed(tel, float(start), start + 5.0, "b", 2.0, True)
    actuator = FakeActuator({}, restart_s=0.0)
    made: list[tuple[float, Decision]] = []
    for now in range(205, 1000, 5):
        foreign = 75 if now >= 500 else 0
        where = [actuator.slot_to_pool.get(f"G/{k}", (A, "{}")) for k in range(4)]
        slots = [SlotState(f"G/{k}", pool, GPU, config, engine=_engine(foreign if pool == A else 0)) for k, (pool, config) in enumerate(where)]
        made += [(float(now), d) for d in tick(controller, actuator, float(now), slots)]
    plans = [(at, d.evidence) for at, d in made if isinstance(d.evidence, PlanEvidence)]
    assert [(e.trigger, e.diff) for _, e in plans] == [
        (None, {A: (4, 3), B: (0, 1)}), ("refine", {}), ("foreign load", {}), ("foreign load", {A: (3, 4), B: (1, 0)})]
    first, _, kept, moved = (e for _, e in plans)
    assert first.foreign_share is None  # engine figures, but none of their requests foreign yet
    assert kept.foreign_share is not None and 0.2 <= kept.foreign_share[A] < 0.5 and plans[2][0] > 500.0  # the window mean, not the tick's
    assert moved.foreign_share is not None and kept.foreign_share[A] + 0.2 <= moved.foreign_share[A] <= 0.5 and moved.outcome == "apply"
    assert "drift" not in [d.kind for at, d in made if at > plans[0][0]]
    assert [actuator.slot_to_pool.get(f"G/{k}", (A, "{}"))[0] for k in range(4)] == [A] * 4  # the rollout ran
    with pytest.raises(ValueError, match="foreign_replan_change"):
        ControllerSettings("llama-3.1-8b", {GPU: 4}, foreign_replan_change=0.0)


def test_the_logged_share_reads_back_and_older_lines_still_read(tmp_path: Path) -> None:
    path = tmp_path / "decisions.jsonl"
    DecisionLog(path).append(Decision(1.0, PlanEvidence(outcome="keep", foreign_share={A: 0.25})))
    entry = json.loads(path.read_text().splitlines()[0])
    assert entry["evidence"]["foreign_share"] == {A: 0.25}
    found = read_decision(entry)
    assert found is not None and isinstance(found.evidence, PlanEvidence) and found.evidence.foreign_share == {A: 0.25}
    older = {"outcome": "keep", "num_moves": 0}  # a line written before the field existed
    assert from_json("plan", older) == PlanEvidence(outcome="keep", num_moves=0)


def _slot(name: str, pool: str, engine: EngineLoad | None, in_flight: int = 0, alive: bool = True) -> SlotState:
    return SlotState(name, pool, GPU, "{}", alive=alive, num_in_flight=in_flight, engine=engine)


def _engine(running: int, waiting: int = 0) -> EngineLoad:
    return EngineLoad(scraped_at=0.0, num_running=running, num_waiting=waiting)


def test_foreign_load_is_the_window_mean_of_each_ticks_pool_mean() -> None:
    load = ForeignLoad(window_s=30.0)
    # tick 0: a's slots hold 10 (running 8 + waiting 6, 4 ours) and 0 foreign; a slot without figures and a
    # dead slot do not count; b has no figures at all
    load.observe(0.0, [_slot("G/0", A, _engine(8, 6), in_flight=4), _slot("G/1", A, _engine(3), in_flight=3),
                       _slot("G/2", A, None), _slot("G/3", A, _engine(100), alive=False), _slot("G/4", B, None)])
    assert load.per_replica(0.0) == {A: 5.0}
    # the gateway has 2 in flight where the engine's older figures showed none: -2, kept so the skew cancels
    load.observe(10.0, [_slot("G/0", A, _engine(20)), _slot("G/1", A, _engine(0), in_flight=2)])
    assert load.per_replica(10.0) == {A: 7.0}
    assert load.per_replica(35.0) == {A: 9.0}  # tick 0 left the window
    load.observe(40.0, [_slot("G/0", A, _engine(0), in_flight=30)])
    assert load.per_replica(40.0) == {A: 0.0}  # a negative mean is no foreign load
    assert load.per_replica(75.0) == {}  # no figures in the window: no foreign load


def test_shares_are_of_the_plans_concurrency_clamped_and_scale_each_shapes_rate() -> None:
    options = Options(
        pools=(PoolOption(A, GPU, 1, (ShapeRate("a", 4.0, 1.0), ShapeRate("c", 2.0, 1.0))), PoolOption.one(B, GPU, "b", 1, 5.0, 1.0)),
        pool_to_config=(), pool_to_concurrency=((A, 40.0), (B, 10.0)))
    shares = foreign_shares(options, {A: 10.0, B: 50.0, "gone@H100-SXM": 3.0})
    assert shares == {A: 0.25, B: 1.0 - MIN_LEFT_SHARE}
    planned = discounted(options, shares)
    assert [s.rate_per_replica_rps for s in planned.pools[0].serves] == [3.0, 1.5]
    assert planned.pools[1].serves[0].rate_per_replica_rps == pytest.approx(5.0 * MIN_LEFT_SHARE)
    assert discounted(options, {}) is options and dataclasses.replace(planned, pools=options.pools) == options
