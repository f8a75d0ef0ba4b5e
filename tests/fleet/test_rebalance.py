"""One GPU budget per kind shared across models (fleet.rebalance): a slot moves from a model whose plan leaves
it idle to one whose plan needs it, one at a time, with a cooldown, never below what the donor's demand needs."""

from __future__ import annotations

from fleet.decisions import Decision, read_decision
from fleet.evidence import PlanEvidence, RebalanceEvidence
from fleet.multi import ModelTelemetry, MultiController
from fleet.rebalance import RebalanceSettings
from fleet.rollout import SlotState
from tests.fleet.test_multi_model import CHAT_JSON, H100, LLAMA, LLAMA_CHAT, QWEN, QWEN_CHAT, _feed, _multi, _run
from tests.fleet.test_planner_rollout import FakeActuator


def _fleet(num_llama: int, num_qwen: int, cooldown_s: float = 300.0) -> tuple[MultiController, ModelTelemetry, list[SlotState]]:
    """``num_llama`` slots in llama's chat pool and ``num_qwen`` in qwen's, on one GPU kind (5 chat rps per replica)."""
    pools = [LLAMA_CHAT] * num_llama + [QWEN_CHAT] * num_qwen
    slots = [SlotState(f"{H100}/{k}", pool.name, H100, CHAT_JSON) for k, pool in enumerate(pools)]
    multi, tel = _multi(slots, RebalanceSettings(cooldown_s=cooldown_s))
    return multi, tel, slots


def _rebalances(decisions: list[Decision]) -> list[tuple[float, RebalanceEvidence]]:
    return [(d.at, d.evidence) for d in decisions if isinstance(d.evidence, RebalanceEvidence)]


def test_a_slot_moves_from_the_idle_model_to_the_one_whose_traffic_outgrew_its_slots() -> None:
    multi, tel, slots = _fleet(num_llama=2, num_qwen=2)
    actuator = FakeActuator({}, restart_s=30.0)
    _feed(tel, QWEN, 0.0, 300.0, {"short-chat": 4.0})
    before, slots = _run(multi, actuator, slots, 5, 300)
    assert not _rebalances(before), before  # qwen's two chat replicas serve its 4 rps: llama's idle slots stay llama's

    _feed(tel, QWEN, 300.0, 700.0, {"short-chat": 14.0})  # needs three replicas of 5 rps; llama has no traffic at all
    after, slots = _run(multi, actuator, slots, 300, 700)
    found = _rebalances(after)
    assert len(found) == 1, after
    at, evidence = found[0]
    assert (evidence.gpu, evidence.slot, evidence.from_model, evidence.to_model, evidence.from_pool) == (H100, f"{H100}/0", LLAMA, QWEN, "llama-chat")
    assert (evidence.to_goodput_before_rps, evidence.to_goodput_after_rps, evidence.to_demand_rps) == (10.0, 14.0, 14.0)
    assert (evidence.from_goodput_before_rps, evidence.from_goodput_after_rps, evidence.from_demand_rps) == (0.0, 0.0, 0.0)
    # qwen's controller plans for its new budget on the same tick and moves the slot into its own pool
    plans = [d for d in after if d.model == QWEN and isinstance(d.evidence, PlanEvidence) and d.at == at]
    assert plans and plans[0].evidence.budget == {H100: 3} and plans[0].evidence.diff == {"qwen-chat": (2, 3)}, plans
    moved = [(m.slot, m.from_pool, m.to_pool) for d in after for m in d.moves]
    assert moved == [(f"{H100}/0", "llama-chat", "qwen-chat")], after
    assert [s.pool for s in slots] == ["qwen-chat", "llama-chat", "qwen-chat", "qwen-chat"]
    assert multi.slot_to_model[f"{H100}/0"] == QWEN and multi.split().model_to_budget == {LLAMA: {H100: 1}, QWEN: {H100: 3}}
    assert not [d for d in after if d.model == LLAMA and d.moves], after  # llama's last replica stays
    line = next(d for d in after if isinstance(d.evidence, RebalanceEvidence)).to_json()
    logged = read_decision(line)
    assert logged is not None and logged.evidence == evidence and logged.model == QWEN  # the log reads it back


def test_no_slot_moves_while_each_model_fits_its_own() -> None:
    multi, tel, slots = _fleet(num_llama=2, num_qwen=2, cooldown_s=0.0)
    actuator = FakeActuator({}, restart_s=30.0)
    _feed(tel, LLAMA, 0.0, 500.0, {"short-chat": 4.0})
    _feed(tel, QWEN, 0.0, 300.0, {"short-chat": 4.0})
    _feed(tel, QWEN, 300.0, 500.0, {"short-chat": 9.0})  # grows, but two replicas of 5 rps still serve it
    decisions, slots = _run(multi, actuator, slots, 5, 500)
    assert not _rebalances(decisions) and not [d for d in decisions if d.moves], decisions
    assert [s.pool for s in slots] == ["llama-chat", "llama-chat", "qwen-chat", "qwen-chat"]


def test_the_donor_keeps_what_its_demand_needs_and_moves_wait_for_the_cooldown() -> None:
    multi, tel, slots = _fleet(num_llama=4, num_qwen=1, cooldown_s=200.0)
    actuator = FakeActuator({}, restart_s=30.0)
    _feed(tel, LLAMA, 0.0, 1500.0, {"short-chat": 7.0})  # needs two of its four replicas
    _feed(tel, QWEN, 0.0, 1500.0, {"short-chat": 14.0})  # would take every slot it could get
    decisions, slots = _run(multi, actuator, slots, 5, 1500)
    found = _rebalances(decisions)
    assert [(e.from_model, e.to_model) for _, e in found] == [(LLAMA, QWEN)] * 2, found  # two of llama's four: no more
    assert found[1][0] - found[0][0] >= 200.0, found
    assert all(e.from_goodput_after_rps == e.from_goodput_before_rps == 7.0 for _, e in found), found
    assert sorted(s.pool for s in slots) == ["llama-chat"] * 2 + ["qwen-chat"] * 3
    assert multi.split().model_to_budget == {LLAMA: {H100: 2}, QWEN: {H100: 3}}


def test_a_slot_whose_move_was_rolled_back_returns_to_its_donor() -> None:
    multi, tel, slots = _fleet(num_llama=2, num_qwen=2)
    actuator = FakeActuator({}, restart_s=30.0, broken=frozenset({"qwen-chat"}))  # a replica started into qwen's pool never answers
    _feed(tel, QWEN, 0.0, 1000.0, {"short-chat": 14.0})
    decisions, slots = _run(multi, actuator, slots, 5, 1000)
    found = _rebalances(decisions)
    assert [(e.slot, e.from_model, e.to_model) for _, e in found][:2] == [(f"{H100}/0", LLAMA, QWEN), (f"{H100}/0", QWEN, LLAMA)], found
    rolled_back = [d for d in decisions if d.kind == "rollback" and d.model == QWEN]
    assert rolled_back and rolled_back[0].at < found[1][0], decisions
    assert "rolled back" in found[1][1].reason
    assert [s.pool for s in slots][:2] == ["llama-chat", "llama-chat"]
    assert multi.slot_to_model[f"{H100}/0"] == LLAMA
