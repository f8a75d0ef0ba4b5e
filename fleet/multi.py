"""Several models under one control loop: one ``Controller`` per model over the slots that model holds.

A slot (one replica's GPUs) serves one model at a time, and a controller plans over every slot it is
handed, so each model's controller must be handed only its own. ``split_slots`` fixes that at
adoption: a slot belongs to the model of the pool it serves in then, and the GPU budget per kind is
split the same way (the slots a model's launched pools hold are its budget; the sum over models is the shared
budget per kind). With ``rebalance`` settings an ``Arbiter`` (fleet.rebalance) moves one slot at a time
from a model whose plan leaves it idle to one whose plan needs it, so the split follows the demand. ``MultiController.tick`` hands each controller its own
slots and returns one ``TickOutput``: every model's decisions (each stamped with its model) and
commands, model by model in name order. ``ModelTelemetry`` is the gateway's telemetry sink: it keeps
one ``Telemetry`` per model, so each controller senses only its own model's traffic.

No I/O and no asyncio: the live edge (gateway/live_fleet.py) and a test drive it the same way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from fleet.commands import Command, TickOutput
from fleet.controller import Controller
from fleet.decisions import Decision
from fleet.rebalance import Arbiter, RebalanceSettings, Transfer
from fleet.rollout import SlotState
from fleet.telemetry import Telemetry


@dataclass(frozen=True, slots=True)
class SlotSplit:
    """Which model owns each slot, and each model's GPU budget (slots per GPU kind)."""

    slot_to_model: Mapping[str, str]
    model_to_budget: Mapping[str, Mapping[str, int]]

    def models(self) -> tuple[str, ...]:
        return tuple(sorted(self.model_to_budget))


def split_slots(slots: Iterable[SlotState], pool_to_model: Mapping[str, str]) -> SlotSplit:
    """Each slot goes to the model its pool serves; raises ValueError for a slot in a pool of no known model
    (a controller handed it would plan another model's replica)."""
    slot_to_model: dict[str, str] = {}
    model_to_budget: dict[str, dict[str, int]] = {}
    for slot in slots:
        model = pool_to_model.get(slot.pool)
        if model is None:
            raise ValueError(f"slot {slot.slot!r} serves in pool {slot.pool!r}, which names no model")
        slot_to_model[slot.slot] = model
        budget = model_to_budget.setdefault(model, {})
        budget[slot.gpu] = budget.get(slot.gpu, 0) + 1
    return SlotSplit(slot_to_model, model_to_budget)


class ModelTelemetry:
    """One ``Telemetry`` per model; a record for a model no controller plans (one served only by
    ``urls`` pools) is dropped, as it moves no replica."""

    def __init__(self, models: Iterable[str], window_s: float = 120.0, bucket_s: float = 5.0) -> None:
        self.model_to_telemetry = {model: Telemetry(window_s, bucket_s) for model in models}

    def of(self, model: str) -> Telemetry:
        return self.model_to_telemetry[model]

    def record_arrival(self, now: float, shape: str, tier: str, prompt_tokens: int, model: str) -> None:
        found = self.model_to_telemetry.get(model)
        if found is not None:
            found.record_arrival(now, shape, tier, prompt_tokens)

    def record_outcome(self, now: float, shape: str, pool: str, met_slo: bool, completion_tokens: int, model: str,
                       cached_tokens: int = 0, of_prompt_tokens: int = 0) -> None:
        found = self.model_to_telemetry.get(model)
        if found is not None:
            found.record_outcome(now, shape, pool, met_slo, completion_tokens, cached_tokens, of_prompt_tokens)


class MultiController:
    """The controllers of several models, ticked together over one snapshot."""

    def __init__(self, model_to_controller: Mapping[str, Controller], slot_to_model: Mapping[str, str],
                 rebalance: RebalanceSettings | None = None) -> None:
        """``rebalance`` None keeps the split static; else an ``Arbiter`` (fleet.rebalance) moves slots between models."""
        for model, controller in model_to_controller.items():
            if controller.settings.model != model:
                raise ValueError(f"the controller given for {model!r} plans {controller.settings.model!r}")
        self.model_to_controller = dict(sorted(model_to_controller.items()))
        self.slot_to_model = dict(slot_to_model)
        self.arbiter = Arbiter(rebalance) if rebalance is not None else None

    def split(self) -> SlotSplit:
        """Who owns each slot now, and each model's configured budget."""
        return SlotSplit(dict(self.slot_to_model), {m: dict(c.settings.gpu_to_budget) for m, c in self.model_to_controller.items()})

    @property
    def busy(self) -> bool:
        """A rollout of any model is in progress (operator moves wait for it)."""
        return any(c.busy for c in self.model_to_controller.values())

    def slots_of(self, model: str, slots: Sequence[SlotState]) -> list[SlotState]:
        return [s for s in slots if self.slot_to_model.get(s.slot) == model]

    def tick(self, now: float, slots: Sequence[SlotState]) -> TickOutput:
        decisions: list[Decision] = []
        commands: list[Command] = []
        if self.arbiter is not None:
            found = self.arbiter.decide(now, self.model_to_controller, self.slot_to_model, slots)
            if found is not None:
                decisions.append(found[0])
                self._transfer(found[1])
        for model, controller in self.model_to_controller.items():
            out = controller.tick(now, self.slots_of(model, slots))
            decisions += [dataclasses.replace(d, model=model) for d in out.decisions]
            commands += out.commands
        return TickOutput(decisions, commands)

    def _transfer(self, transfer: Transfer) -> None:
        """The slot changes owner; both controllers plan for their new budgets on this very tick (the
        receiver's plan moves the slot out of the donor's pool)."""
        self.slot_to_model[transfer.slot] = transfer.to_model
        for model, delta in ((transfer.from_model, -1), (transfer.to_model, 1)):
            controller = self.model_to_controller[model]
            budget = dict(controller.settings.gpu_to_budget)
            budget[transfer.gpu] = budget.get(transfer.gpu, 0) + delta
            controller.set_budget(budget)
