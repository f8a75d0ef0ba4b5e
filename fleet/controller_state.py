"""The controller's persisted state: what a restarted (or standby) controller resumes from.

Plain dataclasses and their JSON form, no I/O (the service writes the file atomically). The state
holds the replica slots (the model and pool each serves, its devices, engine configuration, URL and PID of the
process serving them, and where each is in its life: active, draining, starting, stopped), the plan
version the gateways route on, and per model (one controller each, fleet.multi) a ``LoopState``: the
mix its current plan was made for, back-off and counters, and the rollout in progress: the steps still
to come and each move of the current step with its phase.

A state of format 1 (written when the controller planned one model) reads as one ``LoopState`` under
the model ``""`` and slots of model ``""``: the service gives them its one model.

``capture`` and ``restore`` (and ``capture_arbiter``, ``restore_arbiter``) are the controller's persistence and read its private rollout state
(this module is its friend: keep them in step with fleet/controller.py and fleet/rollout.py).
``restore`` never repeats an applied action: a move whose slot already runs the new configuration
resumes at "starting" (or "done" when it is routable again), so its replica is not stopped twice.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any

from fleet.controller import Controller, _Rollout
from fleet.decisions import Move
from fleet.options import pool_options
from fleet.planner import Plan
from fleet.rebalance import Arbiter, Transfer
from fleet.rollout import SlotState, _Progress
from fleet.telemetry import PoolSlo, ShapeLoad, TrafficMix

FORMAT = 2
SLOT_PHASES = ("active", "draining", "starting", "stopped")


@dataclass(frozen=True, slots=True)
class SlotRecord:
    slot: str
    pool: str
    gpu: str
    config_json: str
    phase: str  # one of SLOT_PHASES
    url: str | None = None
    pid: int | None = None
    drained_at_version: int = 0  # the plan version that first told the gateways to drain it
    model: str = ""  # the model of the pool it serves in ("": a format-1 state's one model)
    devices: tuple[str, ...] = ()  # its ids of fleet.devices (none declared: emulated, or every device visible)

    def state(self) -> SlotState:
        return SlotState(self.slot, self.pool, self.gpu, self.config_json)


@dataclass(frozen=True, slots=True)
class MoveRecord:
    move: Move
    phase: str  # the Mover's: draining, starting, done (or failed)
    since: float


@dataclass(frozen=True, slots=True)
class RolloutRecord:
    plan: Plan
    steps: tuple[tuple[Move, ...], ...]  # still to come
    current: tuple[Move, ...]  # the step being applied
    progress: tuple[MoveRecord, ...]  # the Mover's moves: the current step's, or their reversal in a rollback
    step_done_at: float | None
    goodput_before_rps: float
    healthy_before: bool
    slot_to_old_config: tuple[tuple[str, str], ...]
    rolling_back: bool


@dataclass(frozen=True, slots=True)
class LoopState:
    """One model's controller."""

    reference_mix: TrafficMix
    last_plan_at: float
    backoff_until: float
    num_failures: int
    num_repartitions: int
    num_recompiles: int
    rollout: RolloutRecord | None = None
    refine_at: float | None = None  # when the last drift plan is made again (None: no refine pending)


@dataclass(frozen=True, slots=True)
class ControllerState:
    epoch: str  # names this fleet's plan history; versions count within it
    plan_version: int
    slots: tuple[SlotRecord, ...]
    model_to_loop: tuple[tuple[str, LoopState], ...]  # in model order
    rebalanced_at: float = -math.inf  # the arbiter's last transfer between models (fleet.rebalance)
    lent: Transfer | None = None  # that transfer, while its receiver's rollout may still give the slot back

    @property
    def rollout_in_progress(self) -> bool:
        """Does a model's loop hold a rollout that a leader taking over resumes?"""
        return any(loop.rollout for _, loop in self.model_to_loop)

    def to_json(self) -> dict[str, Any]:
        doc = _encode(asdict(self))
        doc["model_to_loop"] = {model: _encode(asdict(loop)) for model, loop in self.model_to_loop}
        return {"format": FORMAT, **doc}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> ControllerState:
        """Raises ValueError (or KeyError/TypeError, wrapped) on a document this version did not write."""
        if not isinstance(doc, dict):  # `[]` or `null` in the file (was an AttributeError traceback)
            raise ValueError(f"a controller state is a JSON object, not {type(doc).__name__}")
        if doc.get("format") not in (1, FORMAT):
            raise ValueError(f"unknown controller state format {doc.get('format')!r}")
        try:
            loops = {"": doc} if doc["format"] == 1 else doc["model_to_loop"]
            return cls(
                epoch=str(doc["epoch"]),
                plan_version=int(doc["plan_version"]),
                slots=tuple(_slot(s) for s in doc["slots"]),
                model_to_loop=tuple((str(model), _loop(loop)) for model, loop in sorted(loops.items())),
                rebalanced_at=_time(doc.get("rebalanced_at")),
                lent=Transfer(**doc["lent"]) if doc.get("lent") is not None else None,
            )
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"malformed controller state: {exc!r}") from None


# -- JSON: tuples become lists, -inf (never) becomes null ------------------------------------------


def _encode(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _encode(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_encode(v) for v in value]
    if isinstance(value, float) and math.isinf(value):
        return None
    return value


def _time(value: Any) -> float:
    return -math.inf if value is None else float(value)


def _loop(doc: dict[str, Any]) -> LoopState:
    rollout = doc["rollout"]
    return LoopState(
        reference_mix=_mix(doc["reference_mix"]),
        last_plan_at=_time(doc["last_plan_at"]),
        backoff_until=_time(doc["backoff_until"]),
        num_failures=int(doc["num_failures"]),
        num_repartitions=int(doc["num_repartitions"]),
        num_recompiles=int(doc["num_recompiles"]),
        rollout=_rollout(rollout) if rollout is not None else None,
        refine_at=None if doc.get("refine_at") is None else float(doc["refine_at"]),  # absent before refines existed
    )


def _slot(doc: dict[str, Any]) -> SlotRecord:
    record = SlotRecord(**{**doc, "devices": tuple(doc.get("devices", ()))})
    if record.phase not in SLOT_PHASES:
        raise ValueError(f"slot {record.slot!r}: unknown phase {record.phase!r}")
    return record


def _move(doc: dict[str, Any]) -> Move:
    return Move(**doc)


def _moves(docs: list[dict[str, Any]]) -> tuple[Move, ...]:
    return tuple(_move(d) for d in docs)


def _mix(doc: dict[str, Any]) -> TrafficMix:
    shapes = tuple(
        ShapeLoad(s["name"], s["rate_rps"], s["mean_prompt_tokens"], s["mean_output_tokens"],
                  tuple((t, share) for t, share in s["tier_to_share"]), tuple(s["prompt_points"]), tuple(s["output_points"]))
        for s in doc["shapes"]
    )
    return TrafficMix(doc["ended_at"], doc["window_s"], shapes, tuple(PoolSlo(**p) for p in doc["pools"]))


def _rollout(doc: dict[str, Any]) -> RolloutRecord:
    plan = doc["plan"]
    return RolloutRecord(
        plan=Plan(tuple((p, n) for p, n in plan["pool_to_num_replicas"]), plan["predicted_goodput_rps"], plan["objective"]),
        steps=tuple(_moves(step) for step in doc["steps"]),
        current=_moves(doc["current"]),
        progress=tuple(MoveRecord(_move(m["move"]), m["phase"], m["since"]) for m in doc["progress"]),
        step_done_at=doc["step_done_at"],
        goodput_before_rps=doc["goodput_before_rps"],
        healthy_before=doc["healthy_before"],
        slot_to_old_config=tuple((s, c) for s, c in doc["slot_to_old_config"]),
        rolling_back=doc["rolling_back"],
    )


# -- the controller's side ---------------------------------------------------------------------


def capture(controller: Controller) -> LoopState:
    rollout = controller._rollout
    record = None
    if rollout is not None:
        progress = rollout.mover._progress if rollout.mover is not None else []
        record = RolloutRecord(
            plan=rollout.plan,
            steps=tuple(rollout.steps),
            current=rollout.current,
            progress=tuple(MoveRecord(p.move, p.phase, p.since) for p in progress),
            step_done_at=rollout.step_done_at,
            goodput_before_rps=rollout.goodput_before_rps,
            healthy_before=rollout.healthy_before,
            slot_to_old_config=tuple(sorted(rollout.slot_to_old_config.items())),
            rolling_back=rollout.rolling_back,
        )
    return LoopState(
        reference_mix=controller.reference_mix,
        last_plan_at=controller.detector.last_plan_at,
        backoff_until=controller._backoff_until,
        num_failures=controller._num_failures,
        num_repartitions=controller.num_repartitions,
        num_recompiles=controller.num_recompiles,
        rollout=record,
        refine_at=controller._refine_at,
    )


def resumed_phase(move: MoveRecord, slot: SlotRecord | None) -> str:
    """Where a move of the current step stands, from what the slot shows: the controller may have
    died between starting the new replica (recorded with the slot) and recording the move's phase."""
    if move.phase not in ("draining", "starting") or slot is None:
        return move.phase
    applied = (slot.pool, slot.config_json) == (move.move.to_pool, move.move.config_json)
    if applied and slot.phase == "active":
        return "done"
    if applied and slot.phase == "starting":
        return "starting"
    return move.phase


def restore(controller: Controller, state: LoopState, slots: tuple[SlotRecord, ...], now: float) -> None:
    """Put ``controller`` where ``state`` left it; the actuator must already hold ``slots``."""
    controller.reference_mix = state.reference_mix
    controller.detector.on_plan(state.last_plan_at)
    controller._backoff_until = state.backoff_until
    controller._num_failures = state.num_failures
    controller.num_repartitions = state.num_repartitions
    controller.num_recompiles = state.num_recompiles
    controller._refine_at = state.refine_at
    record = state.rollout
    if record is None:
        controller._rollout = None
        return
    s = controller.settings
    options = pool_options(state.reference_mix.shapes, tuple(sorted(s.gpu_to_budget)), controller.capacity, s.tiers, declared=s.declared,
                           model_prefix=s.pool_prefix, made_engines=s.made_engines)
    controller.options = options
    by_slot = {slot.slot: slot for slot in slots}
    progress = tuple(replace(m, phase=resumed_phase(m, by_slot.get(m.move.slot))) for m in record.progress)
    mover = controller._mover((), now)  # no moves: nothing is drained again
    mover._progress = [_Progress(m.move, m.phase, m.since) for m in progress]
    controller._rollout = _Rollout(
        plan=record.plan,
        options=options,
        steps=[tuple(step) for step in record.steps],
        mover=mover,
        current=record.current,
        step_done_at=record.step_done_at,
        goodput_before_rps=record.goodput_before_rps,
        healthy_before=record.healthy_before,
        slot_to_old_config=dict(record.slot_to_old_config),
        rolling_back=record.rolling_back,
    )


def capture_arbiter(arbiter: Arbiter) -> tuple[float, Transfer | None]:
    """(its last transfer's time, that transfer while it may be given back): ``ControllerState``'s
    ``rebalanced_at`` and ``lent``."""
    return arbiter._last_at, arbiter._given


def restore_arbiter(arbiter: Arbiter, state: ControllerState) -> None:
    """A new leader keeps the arbiter's cool-down and gives back a slot whose receiver's rollout fails."""
    arbiter._last_at = state.rebalanced_at
    arbiter._given = state.lent
