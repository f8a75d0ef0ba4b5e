"""The decision log's typed evidence: each kind writes and reads back the same record, old lines
still read, lines that hold no decision are skipped, and a controller's whole log parses."""

from __future__ import annotations

import json
import math
from pathlib import Path

import orjson
import pytest

from fleet.controller import Controller, ControllerSettings
from fleet.decisions import Decision, DecisionLog, LoggedMove, Move, read_decision, read_decisions
from fleet.drift import DriftSettings
from fleet.evidence import (
    KINDS,
    CanaryEvidence,
    CapacityEvidence,
    CompiledEvidence,
    CompileEvidence,
    DriftEvidence,
    Evidence,
    PlanEvidence,
    RebalanceEvidence,
    RecompileEvidence,
    RollbackEvidence,
    StepEvidence,
    VerifyEvidence,
    from_json,
)
from fleet.rollout import SlotState
from fleet.telemetry import Telemetry
from tests.fleet.test_controller_sim import TableCapacity, _feed
from tests.fleet.test_planner_rollout import FakeActuator, tick

MIX = {"shapes": {"short-chat": {"rate_rps": 2.0, "prompt_p50_tokens": 512}}, "window_s": 120.0}
ENVELOPE = {"prompt_points": [512, 1024], "output_points": [128], "ttft_p99_s": 1.0, "tpot_p99_s": 0.05, "tier": "standard"}
EVERY_FIELD: tuple[Evidence, ...] = (
    DriftEvidence(reason="mix divergence", score=2.5, divergence=0.41, rate_change=0.1, profile_change=0.02, dwell_since=970.0,
                  mix_before=MIX, mix_after={"shapes": {}, "window_s": 120.0}),
    CapacityEvidence(lost=("G/2",), recovered=(), budget={"H200": 3}, reason="replica process gone or ejected"),
    PlanEvidence(outcome="apply", diff={"a@H200": (2, 1), "b@H200": (0, 1)}, budget={"H200": 2}, predicted_goodput_before_rps=0.8,
                 predicted_goodput_after_rps=2.9, objective_before=-1.5, objective_after=-0.25, configs={"a@H200": "{}"}, num_moves=1),
    RecompileEvidence(reason="the shape's length profile changed its best configuration"),
    StepEvidence(source="operator", reason="operator move (POST /admin/move)", from_config="{}", to_config='{"tp": 2}',
                 in_flight_at_drain=3, num_steps_left=1, goodput_before_rps=2.5),
    VerifyEvidence(source="operator", ok=True, observed_goodput_rps=2.7, predicted_goodput_rps=2.9, goodput_before_rps=2.5,
                   healthy_before=True, margin=0.1, healthy=True, warmed_up=True, drain_s=0.5, start_to_healthy_s=4.25,
                   drain_deadline_stops=(("G/0", 2),), config="{}"),
    RollbackEvidence(source="operator", outcome="failed", reason="replica never became healthy", backoff_s=300.0, plan_failed=True,
                     never_healthy=("G/1",), start_timeout_s=60.0, drain_s=0.5, start_to_healthy_s=None, drain_deadline_stops=()),
    CompileEvidence(pool="a@H200", gpu="H200", envelope=ENVELOPE, previous_envelope=None, reason="first plan for this pool"),
    CompiledEvidence(pool="a@H200", gpu="H200", envelope=ENVELOPE, old_config=None, new_config={"max_num_seqs": 64},
                     predicted_goodput_rps=3.0, baseline_goodput_rps=2.0, predicted_gain=1.5, evaluator="emulator", trials=12,
                     warm_start=False, run_id="r1", trial_ids=(4, 5), submitted_at=100.0, reason="shape left its envelope"),
    RebalanceEvidence(gpu="H200", slot="G/3", from_model="m1", to_model="m2", from_pool="chat", from_goodput_before_rps=1.5,
                      from_goodput_after_rps=1.5, from_demand_rps=1.5, to_goodput_before_rps=2.0, to_goodput_after_rps=2.75,
                      to_demand_rps=3.0, reason="m2's plan needs another H200 slot"),
    CanaryEvidence(source="operator", pool="chat", canary="chat-0", siblings=("chat-1",), outcome="adopt", reason="faster",
                   old_config='{"max_running_requests":1}', new_config='{"max_running_requests":4}', window_s=20.0,
                   canary_figures={"num_requests": 30, "s_per_token": 0.01}, sibling_figures={"chat-1": {"num_requests": 25, "s_per_token": 0.02}},
                   noise=0.1, noise_source="a/a", noise_figures={"chat-0": {"num_requests": 20}}, margin=0.1, gain=0.5),
)


def _through_the_log(record: Evidence, moves: tuple[Move, ...] = ()) -> dict[str, object]:
    """One decision as a line of the log file, read back as JSON."""
    line = orjson.dumps(Decision(1000.0, record, moves).to_json(), option=orjson.OPT_SORT_KEYS)
    entry = json.loads(line)
    assert isinstance(entry, dict)
    return entry


def test_every_kind_has_a_record() -> None:
    assert sorted(KINDS) == sorted(type(r).kind for r in EVERY_FIELD)


@pytest.mark.parametrize("record", EVERY_FIELD, ids=lambda r: r.kind)
def test_each_kind_round_trips_through_the_log(record: Evidence) -> None:
    moves = (Move("G/0", "a@H200", "b@H200", "{}"),)
    entry = _through_the_log(record, moves)
    assert entry["kind"] == record.kind and entry["at_unix_s"] == 1000.0
    found = read_decision(entry)
    assert found is not None and found.evidence == record and found.kind == record.kind
    assert found.moves == (LoggedMove("G/0", "a@H200", "b@H200"),)
    assert from_json(record.kind, record.to_json()) == record


def test_optional_fields_left_unset_are_not_written() -> None:
    step = StepEvidence(num_steps_left=0, goodput_before_rps=1.0)
    assert step.to_json() == {"num_steps_left": 0, "goodput_before_rps": 1.0}  # no source, reason, configs: the controller's step
    compile_ = EVERY_FIELD[KINDS.index("compile")]
    assert compile_.to_json()["previous_envelope"] is None  # a required field that may be null is written


def test_an_old_line_without_optional_fields_reads_and_they_default() -> None:
    old_plan = {"at_unix_s": 5.0, "kind": "plan", "evidence": {"outcome": "keep", "diff": {}, "predicted_goodput_before_rps": 1.0}}
    found = read_decision(old_plan)
    assert found is not None and found.evidence == PlanEvidence(outcome="keep", diff={}, predicted_goodput_before_rps=1.0)
    assert isinstance(found.evidence, PlanEvidence) and found.evidence.budget is None and found.evidence.configs is None
    drift = EVERY_FIELD[KINDS.index("drift")].to_json()
    del drift["profile_change"]
    parsed = from_json("drift", drift)
    assert isinstance(parsed, DriftEvidence) and parsed.profile_change is None and parsed.reason == "mix divergence"
    # a key a newer version added is ignored; a move with a fourth element (an engine configuration) still reads
    newer = {"at_unix_s": 6.0, "kind": "recompile",
             "evidence": {"reason": "r", "added_later": 1, "moves": [["G/0", "a", "a", "{}"]]}}
    found = read_decision(newer)
    assert found is not None and found.evidence == RecompileEvidence(reason="r") and found.moves == (LoggedMove("G/0", "a", "a"),)


def test_a_non_finite_number_written_as_null_reads_back_as_inf() -> None:
    drift = DriftEvidence(reason="rate change", score=math.inf, divergence=0.0, rate_change=math.inf, dwell_since=1.0,
                          mix_before={}, mix_after={})
    found = read_decision(_through_the_log(drift))
    assert found is not None and found.evidence == drift


@pytest.mark.parametrize("entry", [
    {"at_unix_s": 1.0, "kind": "resize", "evidence": {"reason": "a kind this version does not know"}},
    {"at_unix_s": 1.0, "kind": "verify", "evidence": {"observed_goodput_rps": 1.0}},  # no ok: a required field
    {"at_unix_s": 1.0, "kind": "verify", "evidence": {"ok": "yes"}},  # the wrong type
    {"at_unix_s": 1.0, "kind": "plan", "evidence": {"outcome": "apply", "diff": {"a": [1, 2, 3]}}},
    {"at_unix_s": 1.0, "kind": "step", "evidence": {"moves": [["G/0", "a"]]}},  # a move without its pools
    {"kind": "step", "evidence": {}},  # no time
    {"at_unix_s": 1.0, "kind": "step", "evidence": ["not", "an", "object"]},
    ["not", "an", "entry"],
])
def test_an_entry_that_holds_no_decision_is_skipped(entry: object) -> None:
    assert read_decision(entry) is None
    assert read_decisions([entry, {"at_unix_s": 2.0, "kind": "step", "evidence": {}}]) == [
        read_decision({"at_unix_s": 2.0, "kind": "step", "evidence": {}})]


def test_a_controllers_log_from_a_drift_parses_entirely_into_records(tmp_path: Path) -> None:
    """drift, plan, step, then a verify that fails and a rollback, as in test_controller_sim, through the log file."""
    tel = Telemetry()
    _feed(tel, 0.0, 200.0, "a", 10.0, True)
    settings = ControllerSettings("llama-3.1-8b", {"H100-SXM": 4}, drift=DriftSettings(min_interval_s=0.0), verify_after_s=30.0,
                                  max_step_fraction=0.5)
    actuator = FakeActuator({}, restart_s=0.0)
    controller = Controller(settings, tel, TableCapacity({"a": 5.0, "b": 5.0}), tel.window(200.0))
    slots = [SlotState(f"G/{k}", "a@H100-SXM", "H100-SXM", "{}") for k in range(4)]
    _feed(tel, 200.0, 250.0, "b", 10.0, True)
    made: list[Decision] = []
    for now in range(205, 250, 5):
        made += tick(controller, actuator, float(now), slots)
        moved = {m.slot: m.to_pool for d in made for m in d.moves if d.kind == "step"}
        if moved:
            slots = [SlotState(s.slot, moved.get(s.slot, s.pool), s.gpu, s.config_json) for s in slots]
            break
    _feed(tel, 250.0, 400.0, "b", 10.0, False)  # after the step nothing meets its SLO
    for later in range(int(now) + 5, int(now) + 90, 5):
        made += tick(controller, actuator, float(later), slots)
    path = tmp_path / "decisions.jsonl"
    log = DecisionLog(path, clock_offset_s=1.7e9)
    log.extend(made)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    parsed = read_decisions(lines)
    assert [d.kind for d in parsed] == [d.kind for d in made] == ["drift", "plan", "step", "verify", "rollback"]
    for decision, entry, found in zip(made, lines, parsed, strict=True):
        assert found.evidence == decision.evidence  # the very record the controller made
        assert found.at_unix_s == pytest.approx(decision.at + 1.7e9)
        assert found.moves == tuple(LoggedMove(m.slot, m.from_pool, m.to_pool) for m in decision.moves)
        written = {k: v for k, v in entry["evidence"].items() if k != "moves"}
        assert found.evidence.to_json() == written  # reading and writing again gives the same line
    verify, rollback = (d.evidence for d in parsed[3:])
    assert isinstance(verify, VerifyEvidence) and verify.ok is False and verify.source is None
    assert isinstance(rollback, RollbackEvidence) and rollback.backoff_s == 300.0 and rollback.plan_failed is True
