"""One GPU budget per kind shared across models: a slot moves from a model whose plan leaves it idle to a
model whose plan needs it.

``fleet.multi`` starts from a static split (each model owns the slots its pools held at adoption). The
``Arbiter`` revisits it between rollouts: for each GPU kind it asks every model's own planner (its
controller's latest pool options, for the mix that controller last planned for) what one more slot of
that kind would add to the model's predicted goodput, and what one slot fewer would take from each
other model's. A slot changes owner only when the receiver gains more than ``min_gain`` of its demand
and the donor loses nothing (its plan with one slot fewer predicts the same goodput, so it still
serves what it served). The decision changes ownership and budgets only: the receiver's controller,
told its new budget, re-plans at once and moves the slot out of the donor's pool into one of its own
through its normal plan, step and verification path (drain, stop, start with the receiver's engine,
health, activate), so the arbiter issues no command of its own.

Hysteresis: at most one slot per decision, none while any controller is mid-rollout or backing off,
and ``cooldown_s`` between two decisions (the receiver's rollout and a new plan settle first). A model
keeps at least one slot, so its requests always have a replica to go to.

Deterministic and without I/O: the same controllers, slots and clock give the same decision.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from fleet.controller import Controller
from fleet.decisions import Decision
from fleet.evidence import RebalanceEvidence
from fleet.options import problem_for
from fleet.planner import Plan, plan
from fleet.rollout import SlotState

_NO_LOSS_RPS = 1e-9  # predicted goodputs are LP results: differences below this are rounding


@dataclass(frozen=True, slots=True)
class RebalanceSettings:
    cooldown_s: float = 300.0  # between two slot moves, as the controller's back-off after a failed plan
    min_gain: float = 0.05  # the receiver's predicted goodput must rise by more than this share of its demand

    def __post_init__(self) -> None:
        if self.cooldown_s < 0 or not 0 <= self.min_gain < 1:
            raise ValueError("cooldown_s must be >= 0 and min_gain in [0, 1)")


@dataclass(frozen=True, slots=True)
class Transfer:
    """One slot changing owner: what ``MultiController`` applies to its split and budgets."""

    slot: str
    gpu: str
    from_model: str
    to_model: str
    from_pool: str


def best_plan(controller: Controller, gpu_to_budget: Mapping[str, int]) -> Plan | None:
    """The plan ``controller``'s planner would make for the mix it last planned for over ``gpu_to_budget``;
    an empty plan for a model with no traffic, None when it has not planned yet or no plan fits."""
    mix = controller.reference_mix
    if not mix.shapes:
        return Plan((), 0.0, 0.0)
    if controller.options is None:
        return None
    return plan(problem_for(controller.options, (mix,), gpu_to_budget))


def _plans(controller: Controller, before: Mapping[str, int], after: Mapping[str, int]) -> tuple[Plan, Plan]:
    """Its best plans over two budgets; an empty plan where none fits (only a return's evidence uses these)."""
    empty = Plan((), 0.0, 0.0)
    return best_plan(controller, before) or empty, best_plan(controller, after) or empty


def _with(budget: Mapping[str, int], gpu: str, delta: int) -> dict[str, int]:
    return {**budget, gpu: budget.get(gpu, 0) + delta}


@dataclass(frozen=True, slots=True)
class _Candidate:
    gain_rps: float
    to_model: str
    from_model: str
    slot: str
    from_pool: str
    to_before: Plan
    to_after: Plan
    from_before: Plan
    from_after: Plan


class Arbiter:
    """Decides, tick by tick, whether one slot should change owner (see the module doc)."""

    def __init__(self, settings: RebalanceSettings) -> None:
        self.settings = settings
        self._last_at = -math.inf
        self._given: Transfer | None = None  # the last transfer, until its receiver's rollout is over

    def decide(self, now: float, model_to_controller: Mapping[str, Controller], slot_to_model: Mapping[str, str],
               slots: Sequence[SlotState]) -> tuple[Decision, Transfer] | None:
        given = self._given
        if given is not None and not model_to_controller[given.to_model].busy:
            self._given = None
            back = next((s for s in slots if s.slot == given.slot), None)
            if back is not None and back.pool == given.from_pool:
                return self._give_back(now, given, model_to_controller)
        if now - self._last_at < self.settings.cooldown_s or len(model_to_controller) < 2:
            return None
        if any(c.busy or c.backing_off(now) for c in model_to_controller.values()):
            return None
        alive = [s for s in slots if s.alive and slot_to_model.get(s.slot) in model_to_controller]
        for gpu in sorted({s.gpu for s in alive}):
            found = self._best(gpu, model_to_controller, slot_to_model, alive)
            if found is not None:
                self._last_at = now
                decided = self._decision(now, gpu, found, model_to_controller, "{to}'s plan needs another {gpu} slot; "
                                         "{frm}'s predicts the same goodput without one")
                self._given = decided[1]
                return decided
        return None

    def _give_back(self, now: float, given: Transfer, model_to_controller: Mapping[str, Controller]) -> tuple[Decision, Transfer]:
        """The receiver's move was rolled back: the slot serves in the donor's pool again, running the
        donor's engine, so it is the donor's again (else the receiver would count a slot it cannot use)."""
        holder, donor = model_to_controller[given.to_model], model_to_controller[given.from_model]
        holder_budget, donor_budget = holder.budget(), donor.budget()
        found = _Candidate(0.0, given.from_model, given.to_model, given.slot, given.from_pool,
                           *_plans(donor, donor_budget, _with(donor_budget, given.gpu, 1)),
                           *_plans(holder, holder_budget, _with(holder_budget, given.gpu, -1)))
        return self._decision(now, given.gpu, found, model_to_controller, "{frm}'s move of the slot was rolled back: it serves "
                              "{to}'s pool again")

    def _best(self, gpu: str, model_to_controller: Mapping[str, Controller], slot_to_model: Mapping[str, str],
              alive: Sequence[SlotState]) -> _Candidate | None:
        best: _Candidate | None = None
        for to_model, receiver in sorted(model_to_controller.items()):
            budget = receiver.budget()
            if gpu not in budget:  # its options have no pool on this kind to start the slot into
                continue
            to_before, to_after = best_plan(receiver, budget), best_plan(receiver, _with(budget, gpu, 1))
            if to_before is None or to_after is None:
                continue
            gain = to_after.predicted_goodput_rps - to_before.predicted_goodput_rps
            if gain <= max(_NO_LOSS_RPS, self.settings.min_gain * receiver.reference_mix.total_rate_rps):
                continue
            if best is not None and gain <= best.gain_rps:
                continue
            for from_model, donor in sorted(model_to_controller.items()):
                mine = [s for s in alive if slot_to_model[s.slot] == from_model]
                if from_model == to_model or len(mine) < 2 or not any(s.gpu == gpu for s in mine):
                    continue
                held = donor.budget()
                from_before, from_after = best_plan(donor, held), best_plan(donor, _with(held, gpu, -1))
                if from_before is None or from_after is None:
                    continue
                if from_after.predicted_goodput_rps < from_before.predicted_goodput_rps - _NO_LOSS_RPS:
                    continue
                slot = _donor_slot([s for s in mine if s.gpu == gpu], from_after)
                best = _Candidate(gain, to_model, from_model, slot.slot, slot.pool, to_before, to_after, from_before, from_after)
                break
        return best

    def _decision(self, now: float, gpu: str, c: _Candidate, model_to_controller: Mapping[str, Controller],
                  reason: str) -> tuple[Decision, Transfer]:
        evidence = RebalanceEvidence(
            gpu=gpu, slot=c.slot, from_model=c.from_model, to_model=c.to_model, from_pool=c.from_pool,
            from_goodput_before_rps=round(c.from_before.predicted_goodput_rps, 3),
            from_goodput_after_rps=round(c.from_after.predicted_goodput_rps, 3),
            from_demand_rps=round(model_to_controller[c.from_model].reference_mix.total_rate_rps, 3),
            to_goodput_before_rps=round(c.to_before.predicted_goodput_rps, 3),
            to_goodput_after_rps=round(c.to_after.predicted_goodput_rps, 3),
            to_demand_rps=round(model_to_controller[c.to_model].reference_mix.total_rate_rps, 3),
            reason=reason.format(to=c.to_model, frm=c.from_model, gpu=gpu))
        # stamped with the receiver: its controller carries the move out, and its decisions follow this one
        return Decision(now, evidence, model=c.to_model), Transfer(c.slot, gpu, c.from_model, c.to_model, c.from_pool)


def _donor_slot(slots: Sequence[SlotState], after: Plan) -> SlotState:
    """The donor's slot to give: one in a pool its plan without that slot shrinks (so the donor keeps
    the pools it still needs), then the one holding the fewest requests (the shortest drain), then by name."""
    counts: dict[str, int] = {}
    for slot in slots:
        counts[slot.pool] = counts.get(slot.pool, 0) + 1
    planned = after.replicas()
    return min(slots, key=lambda s: (counts[s.pool] <= planned.get(s.pool, 0), s.num_in_flight, s.slot))
