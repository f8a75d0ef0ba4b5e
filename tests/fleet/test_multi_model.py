"""Several models under one control loop (fleet.multi): each model's controller plans over its own slots
and senses its own traffic; a drift in one model's mix moves only that model's replicas."""

from __future__ import annotations

import pytest

from fleet.commands import apply
from fleet.controller import Controller, ControllerSettings
from fleet.decisions import Decision, read_decision
from fleet.evidence import PlanEvidence
from fleet.multi import ModelTelemetry, MultiController, split_slots
from fleet.options import DeclaredPool
from fleet.rebalance import RebalanceSettings
from fleet.rollout import SlotState
from kernels.config import EngineConfig
from tests.fleet.test_controller_sim import TableCapacity
from tests.fleet.test_planner_rollout import FakeActuator

H100 = "H100-SXM"
LLAMA, QWEN = "llama-3.1-8b", "qwen3-8b"
CHAT_JSON = '{"chunked_prefill_size":2048,"max_running_requests":256,"tp":1}'
CHAT_CONFIG = EngineConfig(max_running_requests=256, chunked_prefill_size=2048)
LLAMA_CHAT = DeclaredPool("llama-chat", H100, ("short-chat",), CHAT_CONFIG, CHAT_JSON)
QWEN_CHAT = DeclaredPool("qwen-chat", H100, ("short-chat",), CHAT_CONFIG, CHAT_JSON)
CAPACITY = TableCapacity({"short-chat": 5.0, "long-context": 1.0})


def _slots() -> list[SlotState]:
    """Two slots of each model's pool, on one GPU kind: the budget per kind is shared by name only."""
    return [SlotState(f"{H100}/{k}", pool.name, H100, CHAT_JSON) for k, pool in enumerate([LLAMA_CHAT, LLAMA_CHAT, QWEN_CHAT, QWEN_CHAT])]


def _feed(tel: ModelTelemetry, model: str, start: float, end: float, shape_to_rps: dict[str, float]) -> None:
    arrivals = sorted((start + k / rate, shape) for shape, rate in shape_to_rps.items() for k in range(int((end - start) * rate)))
    for at, shape in arrivals:
        tel.record_arrival(at, shape, "standard", 6000 if shape == "long-context" else 800, model)
        tel.record_outcome(at, shape, "any", True, 200, model)


def _multi(slots: list[SlotState], rebalance: RebalanceSettings | None = None) -> tuple[MultiController, ModelTelemetry]:
    """Each model's Controller over the slots of its chat pool (``rebalance``: a budget shared across them)."""
    split = split_slots(slots, {LLAMA_CHAT.name: LLAMA, QWEN_CHAT.name: QWEN})
    tel = ModelTelemetry(split.models())
    declared = {LLAMA: (LLAMA_CHAT,), QWEN: (QWEN_CHAT,)}
    controllers = {
        model: Controller(ControllerSettings(model, split.model_to_budget[model], declared=declared[model], verify_after_s=30.0),
                          tel.of(model), CAPACITY, tel.of(model).window(0.0))
        for model in split.models()}
    return MultiController(controllers, split.slot_to_model, rebalance), tel


def _run(multi: MultiController, actuator: FakeActuator, slots: list[SlotState], start: int, end: int) -> tuple[list[Decision], list[SlotState]]:
    decisions: list[Decision] = []
    for now in range(start, end, 5):
        out = multi.tick(float(now), actuator.facts(slots, float(now)))
        apply(out.commands, actuator, float(now))
        decisions += out.decisions
        slots = [SlotState(s.slot, pool, s.gpu, config) for s in slots for pool, config in [actuator.slot_to_pool.get(s.slot, (s.pool, s.config_json))]]
    return decisions, slots


def test_each_model_owns_the_slots_its_pools_hold_at_adoption() -> None:
    split = split_slots(_slots(), {LLAMA_CHAT.name: LLAMA, QWEN_CHAT.name: QWEN})
    assert split.model_to_budget == {LLAMA: {H100: 2}, QWEN: {H100: 2}}
    assert [split.slot_to_model[f"{H100}/{k}"] for k in range(4)] == [LLAMA, LLAMA, QWEN, QWEN]
    with pytest.raises(ValueError, match="'stray'"):
        split_slots([SlotState("G/0", "stray", "G", "{}")], {LLAMA_CHAT.name: LLAMA})


def test_a_drift_in_one_models_mix_moves_only_that_models_replicas() -> None:
    slots = _slots()
    multi, tel = _multi(slots)
    actuator = FakeActuator({}, restart_s=30.0)
    for model in (LLAMA, QWEN):
        _feed(tel, model, 0.0, 300.0, {"short-chat": 4.0})
    before, slots = _run(multi, actuator, slots, 5, 300)
    assert not [d for d in before if d.moves], before  # both chat pools fit their chat traffic
    budgets = {d.model: d.evidence.budget for d in before if isinstance(d.evidence, PlanEvidence)}
    assert budgets == {LLAMA: {H100: 2}, QWEN: {H100: 2}}  # neither plans over the other's slots

    # llama's traffic turns to long prompts (no declared pool serves them); qwen's stays chat
    _feed(tel, LLAMA, 300.0, 700.0, {"short-chat": 3.0, "long-context": 1.0})
    _feed(tel, QWEN, 300.0, 700.0, {"short-chat": 4.0})
    after, slots = _run(multi, actuator, slots, 300, 700)
    assert [d.kind for d in after if d.model == LLAMA][:3] == ["drift", "plan", "step"], after
    assert all(d.model in (LLAMA, QWEN) for d in after)
    assert not [d for d in after if d.model == QWEN and d.kind in ("drift", "step", "rollback")], after
    moved = {m.slot for d in after for m in d.moves}
    assert moved and moved <= {f"{H100}/0", f"{H100}/1"}, moved  # only llama's slots
    assert [s.pool for s in slots] == ["llama-chat", "long-context@H100-SXM", "qwen-chat", "qwen-chat"]
    # the decision log's line names the model; a reader of the older format reads it as before
    line = after[0].to_json()
    assert line["model"] == LLAMA and set(line) == {"at_unix_s", "kind", "evidence", "model"}
    found = read_decision(line)
    assert found is not None and found.model == LLAMA and found.kind == after[0].kind
    line.pop("model")
    older = read_decision(line)
    assert older is not None and older.model == ""


def test_a_model_without_a_controller_leaves_the_others_telemetry_untouched() -> None:
    tel = ModelTelemetry([LLAMA])
    tel.record_arrival(1.0, "short-chat", "standard", 100, QWEN)
    tel.record_arrival(1.0, "short-chat", "standard", 100, LLAMA)
    assert tel.of(LLAMA).window(20.0).shapes[0].rate_rps > 0
    assert list(tel.model_to_telemetry) == [LLAMA]
