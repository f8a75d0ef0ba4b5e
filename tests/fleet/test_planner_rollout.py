"""Planner against brute force; plan diffs, step batching, drain-first moves with deadlines and the decision log."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

from fleet.commands import Activate, Drain, Start, Stop, apply
from fleet.controller import Controller
from fleet.decisions import Decision, DecisionLog, Move
from fleet.evidence import DriftEvidence, RecompileEvidence, StepEvidence
from fleet.planner import PlanProblem, PoolOption, allows, brute_force, plan
from fleet.rollout import Mover, SlotState, batch_moves, diff_moves, rolling_batches


def _problem(rng: random.Random) -> PlanProblem:
    weight = {s: rng.choice([1.0, 2.0, 4.0]) for s in "abc"}
    pools = tuple(
        PoolOption.one(f"{s}@{g}", g, s, rng.choice([1, 1, 2]), rng.uniform(1, 10), weight[s])
        for s in "abc" for g in ("H100", "H200")
    )
    windows = (tuple((s, rng.uniform(0, 20)) for s in "ab"), tuple((s, rng.uniform(0, 20)) for s in "bc"))
    return PlanProblem(
        pools, (("H100", rng.randint(0, 4)), ("H200", rng.randint(1, 4))), windows, (0.5, 0.5),
        current=tuple((p.name, rng.randint(0, 1)) for p in pools),
        move_cost=tuple((p.name, rng.uniform(0, 2)) for p in pools),
    )


def test_milp_matches_brute_force_on_small_instances() -> None:
    rng = random.Random(7)
    for _ in range(25):
        problem = _problem(rng)
        fast, slow = plan(problem), brute_force(problem)
        assert fast is not None and slow is not None
        assert abs(fast.objective - slow.objective) < 1e-6


def test_move_cost_keeps_a_plan_whose_gain_is_small() -> None:
    pools = (PoolOption.one("a@G", "G", "a", 1, 10.0, 1.0), PoolOption.one("b@G", "G", "b", 1, 10.0, 1.0))
    demand = ((("a", 10.5), ("b", 9.5)),)
    base = PlanProblem(pools, (("G", 2),), demand, (1.0,), current=(("a@G", 0), ("b@G", 2)))
    assert plan(base).replicas() == {"a@G": 1, "b@G": 1}  # free moves: follow the demand
    costly = PlanProblem(pools, (("G", 2),), (((("a", 1.0), ("b", 9.5))),), (1.0,),
                         current=(("a@G", 0), ("b@G", 2)), move_cost=(("a@G", 2.0), ("b@G", 2.0)))
    assert plan(costly).replicas() == {"a@G": 0, "b@G": 2}  # 1 req/s gained does not pay 4 of cost


def test_allows_only_the_problems_pools_within_their_bounds_and_the_budget() -> None:
    pools = (PoolOption.one("a@G", "G", "a", 1, 10.0, 1.0, min_replicas=1), PoolOption.one("b@G", "G", "b", 2, 10.0, 1.0, max_replicas=1))
    problem = PlanProblem(pools, (("G", 5),), ((("a", 1.0),),), (1.0,))
    assert allows(problem, {"a@G": 1, "b@G": 1})
    assert not allows(problem, {"a@G": 4, "b@G": 1})  # 6 GPUs of 5
    assert not allows(problem, {"a@G": 1, "b@G": 2})  # b's maximum
    assert not allows(problem, {"b@G": 1})  # a's minimum
    assert not allows(problem, {"a@G": 1, "c@G": 1})  # a pool the problem does not have


def test_diff_moves_within_gpu_kind_and_recompiles_in_place() -> None:
    slots = [SlotState("G/0", "a@G", "G", "{}"), SlotState("G/1", "a@G", "G", "{}"), SlotState("G/2", "b@G", "G", "{}")]
    moves = diff_moves(slots, {"a@G": 1, "b@G": 2}, {"a@G": "G", "b@G": "G"}, {"a@G": "{}", "b@G": '{"x": 1}'})
    assert moves == [Move("G/1", "a@G", "b@G", '{"x": 1}'), Move("G/2", "b@G", "b@G", '{"x": 1}')]
    assert batch_moves(moves * 3, fleet_size=8, max_fraction=0.25) == [tuple(moves), tuple(moves), tuple(moves)]


def test_recompiles_restart_one_replica_of_a_pool_per_step() -> None:
    a = [Move(f"G/{k}", "a@G", "a@G", "{}") for k in range(3)]
    b = [Move(f"G/{k}", "b@G", "b@G", "{}") for k in range(3, 5)]
    assert rolling_batches(a + b, fleet_size=8, max_fraction=0.25) == [(a[0], b[0]), (a[1], b[1]), (a[2],)]
    assert rolling_batches(a + b, fleet_size=8, max_fraction=0.1) == [(m,) for m in a + b]  # the fleet's bound still holds
    assert rolling_batches([], fleet_size=8, max_fraction=0.25) == []


class FakeActuator:
    """An edge that records the commands it applies; a slot is healthy ``restart_s`` after its start
    unless the slot or the pool it starts in is in ``broken`` (then never), and serves (healthy) before
    any start; ``slot_to_pool`` is where activated slots serve."""

    def __init__(self, in_flight: dict[str, int], restart_s: float, broken: frozenset[str] = frozenset()) -> None:
        self.in_flight = in_flight
        self.restart_s = restart_s
        self.broken = set(broken)
        self.calls: list[tuple[str, str, float]] = []
        self.started_at: dict[str, float] = {}
        self.starting: dict[str, tuple[str, str]] = {}
        self.slot_to_pool: dict[str, tuple[str, str]] = {}  # slot -> (pool, config_json) it serves in

    def drain(self, slot: str, now: float) -> None:
        self.calls.append(("drain", slot, now))

    def stop(self, slot: str, now: float) -> None:
        self.calls.append(("stop", slot, now))
        self.slot_to_pool.pop(slot, None)

    def start(self, slot: str, pool: str, config_json: str, now: float) -> None:
        self.calls.append(("start", slot, now))
        self.started_at[slot] = now
        self.starting[slot] = (pool, config_json)

    def activate(self, slot: str, now: float) -> None:
        self.calls.append(("activate", slot, now))
        self.slot_to_pool[slot] = self.starting[slot]

    def is_healthy(self, slot: str, now: float) -> bool:
        if slot in self.broken or self.starting.get(slot, ("", ""))[0] in self.broken:
            return False
        return slot not in self.started_at or now >= self.started_at[slot] + self.restart_s

    def facts(self, slots: list[SlotState], now: float) -> list[SlotState]:
        """``slots`` with what this edge knows: requests in flight, health."""
        return [dataclasses.replace(s, num_in_flight=self.in_flight.get(s.slot, 0), healthy=self.is_healthy(s.slot, now)) for s in slots]


def tick(controller: Controller, actuator: FakeActuator, now: float, slots: list[SlotState]) -> list[Decision]:
    """One tick as an edge runs it: snapshot, decide, apply the commands."""
    out = controller.tick(now, actuator.facts(slots, now))
    apply(out.commands, actuator, now)
    return out.decisions


def _advance(mover: Mover, act: FakeActuator, now: float) -> None:
    slots = act.facts([SlotState("G/0", "a@G", "G", "{}")], now)
    apply(mover.advance(now, {s.slot: s for s in slots}), act, now)


def test_mover_drains_before_it_stops_and_activates_only_when_healthy() -> None:
    act = FakeActuator({"G/0": 2}, restart_s=30.0)
    mover = Mover((Move("G/0", "a@G", "b@G", "{}"),), 0.0)
    _advance(mover, act, 0.0)
    _advance(mover, act, 5.0)
    assert act.calls == [("drain", "G/0", 0.0)]  # requests still in flight: nothing stopped
    act.in_flight["G/0"] = 0
    _advance(mover, act, 10.0)
    _advance(mover, act, 20.0)
    assert act.calls[1:] == [("stop", "G/0", 10.0), ("start", "G/0", 10.0)] and not mover.done
    _advance(mover, act, 40.0)
    assert act.calls[-1] == ("activate", "G/0", 40.0) and mover.done


def test_mover_forces_a_drain_past_its_deadline_and_fails_a_start_past_its_own() -> None:
    act = FakeActuator({"G/0": 3}, restart_s=30.0, broken=frozenset({"b@G"}))
    move = Move("G/0", "a@G", "b@G", "{}")
    mover = Mover((move,), 0.0, drain_timeout_s=60.0, start_timeout_s=100.0)
    _advance(mover, act, 0.0)
    _advance(mover, act, 59.0)
    assert act.calls == [("drain", "G/0", 0.0)] and not mover.forced_stops
    _advance(mover, act, 60.0)  # three requests still in flight: stopped anyway, and said so
    assert act.calls[1:] == [("stop", "G/0", 60.0), ("start", "G/0", 60.0)] and mover.forced_stops == [("G/0", 3)]
    _advance(mover, act, 159.0)
    assert not mover.done and not mover.failed
    _advance(mover, act, 160.0)  # never healthy: the move failed, nothing was made routable
    assert mover.done and mover.failed == (move,) and "activate" not in [c[0] for c in act.calls]


def test_a_fact_read_in_the_tick_that_issued_a_command_is_not_trusted_for_it() -> None:
    """The slot drained in this tick holds no request in this tick's snapshot (it was taken before the
    drain), and the slot started in this tick answers /health there (its old engine did): neither may
    move the step on before the next snapshot."""
    mover = Mover((Move("G/0", "a@G", "b@G", "{}"),), 0.0)
    idle_and_healthy = {"G/0": SlotState("G/0", "a@G", "G", "{}")}
    assert mover.advance(0.0, idle_and_healthy) == [Drain("G/0")]
    assert mover.advance(5.0, idle_and_healthy) == [Stop("G/0"), Start("G/0", "b@G", "{}")]
    assert mover.advance(10.0, idle_and_healthy) == [Activate("G/0")] and mover.done


def test_decision_log_writes_json_lines_with_a_bounded_tail(tmp_path: Path) -> None:
    path = tmp_path / "decisions.jsonl"
    log = DecisionLog(path, max_tail=2, clock_offset_s=1000.0)
    for k in range(3):
        log.append(Decision(float(k), StepEvidence(reason=f"r{k}"), (Move("G/0", "a", "b", "{}"),)))
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["at_unix_s"] for line in lines] == [1000.0, 1001.0, 1002.0]
    assert lines[0] == {"at_unix_s": 1000.0, "kind": "step", "evidence": {"reason": "r0", "moves": [["G/0", "a", "b"]]}}
    assert [e["evidence"]["reason"] for e in log.tail()] == ["r1", "r2"]


def test_a_decision_log_that_refuses_writes_queues_lines_and_writes_them_once_it_can(tmp_path: Path) -> None:
    path = tmp_path / "decisions.jsonl"
    path.mkdir()  # a directory where the file should be: every write fails
    log = DecisionLog(path, max_unwritten=2)
    for k in range(3):
        log.append(Decision(float(k), RecompileEvidence(reason=f"r{k}")))
    assert [e["evidence"]["reason"] for e in log.tail()] == ["r0", "r1", "r2"]  # the tail still serves them
    health = log.health()
    assert "Is a directory" in health["write_error"] and health["unwritten"] == 2 and health["dropped"] == 1
    path.rmdir()
    log.append(Decision(3.0, RecompileEvidence(reason="r3")))
    written = [json.loads(line)["evidence"]["reason"] for line in path.read_text().splitlines()]
    assert written == ["r1", "r2", "r3"] and log.health()["write_error"] is None and log.num_unwritten == 0


def test_opening_a_corrupted_decision_log_skips_bad_lines_and_counts_them(tmp_path: Path) -> None:
    path = tmp_path / "decisions.jsonl"
    good = json.dumps({"at_unix_s": 1.0, "kind": "plan", "evidence": {"reason": "kept"}})
    path.write_bytes(b"\n".join([good.encode(), b'{"at_unix_s": 2.0, "kind": "pl', b"\xff\xfe not utf-8", b"[1, 2]", b"", good.encode()]) + b"\n")
    log = DecisionLog()
    log.open(path)
    assert [e["evidence"]["reason"] for e in log.tail()] == ["kept", "kept"] and log.health()["skipped_lines"] == 3
    log.append(Decision(5.0, StepEvidence(reason="new")))
    assert json.loads(path.read_bytes().splitlines()[-1])["evidence"]["reason"] == "new"


def test_decision_log_lines_are_strict_json(tmp_path: Path) -> None:
    """Regression: a drift score of inf was written as ``Infinity``, which strict JSON readers reject."""
    path = tmp_path / "decisions.jsonl"
    DecisionLog(path).append(Decision(0.0, DriftEvidence(reason="rate change", score=float("inf"), divergence=0.0, rate_change=float("inf"),
                                                      dwell_since=0.0, mix_before={}, mix_after={})))

    def strict(name: str) -> None:
        raise ValueError(f"non-standard JSON constant {name}")

    assert json.loads(path.read_text(), parse_constant=strict)["evidence"]["score"] is None
