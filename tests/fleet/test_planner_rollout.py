"""Planner against brute force; plan diffs, step batching, drain-first moves and the decision log."""

from __future__ import annotations

import json
import random
from pathlib import Path

from fleet.decisions import DecisionLog, Move, decision
from fleet.planner import PlanProblem, PoolOption, brute_force, plan
from fleet.rollout import Mover, SlotState, batch_moves, diff_moves


def _problem(rng: random.Random) -> PlanProblem:
    weight = {s: rng.choice([1.0, 2.0, 4.0]) for s in "abc"}
    pools = tuple(
        PoolOption(f"{s}@{g}", g, s, rng.choice([1, 1, 2]), rng.uniform(1, 10), weight[s])
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
    pools = (PoolOption("a@G", "G", "a", 1, 10.0, 1.0), PoolOption("b@G", "G", "b", 1, 10.0, 1.0))
    demand = ((("a", 10.5), ("b", 9.5)),)
    base = PlanProblem(pools, (("G", 2),), demand, (1.0,), current=(("a@G", 0), ("b@G", 2)))
    assert plan(base).replicas() == {"a@G": 1, "b@G": 1}  # free moves: follow the demand
    costly = PlanProblem(pools, (("G", 2),), (((("a", 1.0), ("b", 9.5))),), (1.0,),
                         current=(("a@G", 0), ("b@G", 2)), move_cost=(("a@G", 2.0), ("b@G", 2.0)))
    assert plan(costly).replicas() == {"a@G": 0, "b@G": 2}  # 1 req/s gained does not pay 4 of cost


def test_diff_moves_within_gpu_kind_and_recompiles_in_place() -> None:
    slots = [SlotState("G/0", "a@G", "G", "{}"), SlotState("G/1", "a@G", "G", "{}"), SlotState("G/2", "b@G", "G", "{}")]
    moves = diff_moves(slots, {"a@G": 1, "b@G": 2}, {"a@G": "G", "b@G": "G"}, {"a@G": "{}", "b@G": '{"x": 1}'})
    assert moves == [Move("G/1", "a@G", "b@G", '{"x": 1}'), Move("G/2", "b@G", "b@G", '{"x": 1}')]
    assert batch_moves(moves * 3, fleet_size=8, max_fraction=0.25) == [tuple(moves), tuple(moves), tuple(moves)]


class FakeActuator:
    """Records calls; a slot drains when told, is healthy ``restart_s`` after start."""

    def __init__(self, in_flight: dict[str, int], restart_s: float) -> None:
        self.in_flight = in_flight
        self.restart_s = restart_s
        self.calls: list[tuple[str, str, float]] = []
        self.started_at: dict[str, float] = {}

    def drain(self, slot: str, now: float) -> None:
        self.calls.append(("drain", slot, now))

    def num_in_flight(self, slot: str) -> int:
        return self.in_flight.get(slot, 0)

    def stop(self, slot: str, now: float) -> None:
        self.calls.append(("stop", slot, now))

    def start(self, slot: str, pool: str, config_json: str, now: float) -> None:
        self.calls.append(("start", slot, now))
        self.started_at[slot] = now

    def is_healthy(self, slot: str, now: float) -> bool:
        return slot in self.started_at and now >= self.started_at[slot] + self.restart_s

    def activate(self, slot: str, now: float) -> None:
        self.calls.append(("activate", slot, now))


def test_mover_drains_before_it_stops_and_activates_only_when_healthy() -> None:
    act = FakeActuator({"G/0": 2}, restart_s=30.0)
    mover = Mover(act, (Move("G/0", "a@G", "b@G", "{}"),), 0.0)
    mover.advance(5.0)
    assert act.calls == [("drain", "G/0", 0.0)]  # requests still in flight: nothing stopped
    act.in_flight["G/0"] = 0
    mover.advance(10.0)
    mover.advance(20.0)
    assert act.calls[1:] == [("stop", "G/0", 10.0), ("start", "G/0", 10.0)] and not mover.done
    mover.advance(40.0)
    assert act.calls[-1] == ("activate", "G/0", 40.0) and mover.done


def test_decision_log_writes_json_lines_with_a_bounded_tail(tmp_path: Path) -> None:
    path = tmp_path / "decisions.jsonl"
    log = DecisionLog(path, max_tail=2, clock_offset_s=1000.0)
    for k in range(3):
        log.append(decision(float(k), "step", moves=(Move("G/0", "a", "b", "{}"),), reason=f"r{k}"))
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["at_unix_s"] for line in lines] == [1000.0, 1001.0, 1002.0]
    assert lines[0] == {"at_unix_s": 1000.0, "kind": "step", "evidence": {"reason": "r0", "moves": [["G/0", "a", "b"]]}}
    assert [e["evidence"]["reason"] for e in log.tail()] == ["r1", "r2"]
