"""The evidence of each decision kind as a typed record, and the one parser that reads it back.

A record's fields are the keys of the ``evidence`` object in the decision log, in the order they
are written. A field without a default is required: every line of that kind carries it (it may
be ``null`` where its type says so, as a compile's ``previous_envelope``). A field with a default
is optional: only some emitters or some versions write it (the operator's timings, the budget a
plan was made for); it defaults to ``None`` and is left out of the line when it is ``None``, so
lines keep the keys they had before the records existed.

``from_json(kind, evidence)`` reads a logged evidence object back: an optional field that is
missing or ``null`` is ``None``; a missing required field, a value of the wrong type or a kind
that is not one of ``KINDS`` gives ``None`` (the reader skips the line, as it skips one that is
not JSON). Keys the record does not know are ignored, so a line from a newer version still reads.
The log writes a non-finite number as ``null`` (strict JSON); a required number read back as
``null`` is ``inf``, the only non-finite value these records carry (a drift from no traffic, a
compile's gain over a zero baseline).
"""

from __future__ import annotations

import math
import types
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Union, get_args, get_origin, get_type_hints


class _Record:
    """What every evidence record shares: its kind, and the JSON object it is logged as."""

    __slots__ = ()
    kind: ClassVar[str]

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in fields(self):  # type: ignore[arg-type]  # every subclass is a dataclass
            value = getattr(self, f.name)
            if value is None and f.default is None:
                continue  # an optional field this emitter (or this version) does not write
            out[f.name] = _plain(value)
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class DriftEvidence(_Record):
    """The traffic mix left the one the fleet was planned for (``fleet/drift.py``)."""

    kind: ClassVar[str] = "drift"
    reason: str
    score: float
    divergence: float
    rate_change: float
    profile_change: float | None = None
    dwell_since: float  # the controller's clock: when the score first went over the threshold
    mix_before: dict[str, Any]  # TrafficMix.to_json() the fleet was planned for
    mix_after: dict[str, Any]  # TrafficMix.to_json() of the live window
    tuning_dropped: int | None = None  # in-place recompiles of the running rollout this drift cancelled


@dataclass(frozen=True, slots=True, kw_only=True)
class CapacityEvidence(_Record):
    """Replica slots died or came back: the GPU budget the planner allocates changed."""

    kind: ClassVar[str] = "capacity"
    lost: tuple[str, ...]  # slot names
    recovered: tuple[str, ...]
    budget: dict[str, int]  # GPU kind -> slots alive
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanEvidence(_Record):
    """A plan for the current mix: ``outcome`` is apply, keep, infeasible, or oracle (the simulator's bound)."""

    kind: ClassVar[str] = "plan"
    outcome: str
    diff: dict[str, tuple[int, int]] | None = None  # pool -> (replicas before, after), changed pools only
    budget: dict[str, int] | None = None
    predicted_goodput_before_rps: float | None = None
    predicted_goodput_after_rps: float | None = None
    objective_before: float | None = None
    objective_after: float | None = None
    configs: dict[str, str] | None = None  # pool -> engine configuration JSON
    num_moves: int | None = None
    # pool -> share of its replicas' capacity held by requests the gateway did not send (engine figures);
    # each replica's rate was scaled by (1 - share) for the plan. Absent: no pool had foreign load.
    foreign_share: dict[str, float] | None = None
    # "foreign load": the foreign shares moved with the mix steady; "refine": the drift plan again, from a window
    # of only the new mix; absent: drift, capacity, a compile
    trigger: str | None = None
    # outcome keep because the plan's predicted gain (predicted_goodput_after - before) was under noise_rps, the
    # counting noise of the sample it was planned from (counting_noise_rps): the changes it would have made
    declined: dict[str, tuple[int, int]] | None = None
    noise_rps: float | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class RecompileEvidence(_Record):
    """Replicas restarted in their own pool with a new configuration (the moves say which)."""

    kind: ClassVar[str] = "recompile"
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class StepEvidence(_Record):
    """One step of a rollout began (its moves drain). The controller writes ``num_steps_left`` and
    ``goodput_before_rps``; an operator move (``source`` "operator") its reason and configurations."""

    kind: ClassVar[str] = "step"
    source: str | None = None  # "operator" for POST /admin/move; absent for the controller
    reason: str | None = None
    from_config: str | None = None
    to_config: str | None = None
    in_flight_at_drain: int | None = None
    num_steps_left: int | None = None
    goodput_before_rps: float | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class VerifyEvidence(_Record):
    """A step's moves serve: the controller compares goodput with its prediction; the operator
    reports the replica healthy and its timings."""

    kind: ClassVar[str] = "verify"
    source: str | None = None
    ok: bool
    observed_goodput_rps: float | None = None
    predicted_goodput_rps: float | None = None
    goodput_before_rps: float | None = None
    healthy_before: bool | None = None  # whether the fleet met its demand before the step (else it was not judged)
    margin: float | None = None
    noise_rps: float | None = None  # how far below the margin's floor goodput may read before it fails (counting_noise_rps)
    healthy: bool | None = None
    warmed_up: bool | None = None
    drain_s: float | None = None
    start_to_healthy_s: float | None = None
    drain_deadline_stops: tuple[tuple[str, int], ...] | None = None  # (slot, requests still in flight) stopped at the drain deadline
    # (slot, requests waiting inside its engine, requests the gateway had in flight there) of each moved
    # replica whose engine reported figures; ``engine_backlogged`` names those that queued what the plan said they run
    engine_waiting: tuple[tuple[str, int, int], ...] | None = None
    engine_backlogged: tuple[str, ...] | None = None
    config: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class RollbackEvidence(_Record):
    """Moves going back to their old pool and configuration (the moves are the reversals), or
    ``outcome`` "failed" when the old configuration did not come back either."""

    kind: ClassVar[str] = "rollback"
    source: str | None = None
    outcome: str | None = None  # "failed" or (operator) "restored"; absent when a rollback begins
    reason: str
    backoff_s: float | None = None
    plan_failed: bool | None = None
    never_healthy: tuple[str, ...] | None = None  # slots that never became healthy
    start_timeout_s: float | None = None
    drain_s: float | None = None
    start_to_healthy_s: float | None = None
    drain_deadline_stops: tuple[tuple[str, int], ...] | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class CompileEvidence(_Record):
    """A configuration compile was asked for a pool's (GPU kind, envelope)."""

    kind: ClassVar[str] = "compile"
    pool: str
    gpu: str
    envelope: dict[str, Any]  # Envelope.to_json()
    previous_envelope: dict[str, Any] | None  # None: the pool's first plan
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class CompiledEvidence(_Record):
    """A compile finished: the configuration it found for a pool and its predicted gain."""

    kind: ClassVar[str] = "compiled"
    pool: str
    gpu: str
    envelope: dict[str, Any]
    old_config: dict[str, Any] | None  # the pool's configuration (its non-default fields), None when it had none
    new_config: dict[str, Any]
    predicted_goodput_rps: float
    baseline_goodput_rps: float
    predicted_gain: float
    evaluator: str
    trials: int
    warm_start: bool | None = None
    run_id: str | None = None
    trial_ids: tuple[int, ...] | None = None
    submitted_at: float | None = None
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class RebalanceEvidence(_Record):
    """One slot of a GPU kind changed owner between two models' controllers (fleet.rebalance): the receiver's
    predicted goodput for the mix it last planned for rises by more than the donor's falls (it does not)."""

    kind: ClassVar[str] = "rebalance"
    gpu: str
    slot: str
    from_model: str
    to_model: str
    from_pool: str  # where the slot served the donor; the receiver's next plan moves it into one of its pools
    from_goodput_before_rps: float
    from_goodput_after_rps: float
    from_demand_rps: float
    to_goodput_before_rps: float
    to_goodput_after_rps: float
    to_demand_rps: float
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class CanaryEvidence(_Record):
    """A canary trial's verdict (fleet.canary): one replica of ``pool`` on ``new_config`` against its siblings on
    ``old_config`` over the same window; ``adopt`` (the siblings follow), ``roll back`` (the canary restarts on the
    old configuration) or ``abandoned`` (too few requests to measure the noise before it began)."""

    kind: ClassVar[str] = "canary"
    source: str | None = None  # "operator" for POST /admin/canary; absent for the controller
    pool: str
    canary: str  # its slot
    siblings: tuple[str, ...]
    outcome: str
    reason: str
    old_config: str
    new_config: str
    window_s: float  # how long both sides were measured (fleet seconds)
    canary_figures: dict[str, Any]  # fleet.replica_outcomes.ReplicaFigures.to_json()
    sibling_figures: dict[str, Any]  # slot -> figures, over the same window
    noise: float | None = None  # relative spread of s_per_token between replicas on one configuration
    noise_source: str | None = None  # "siblings" or "a/a" (canary slot and its sibling before the trial)
    noise_figures: dict[str, Any] | None = None
    aa_ratio: float | None = None  # a/a: canary slot / sibling s_per_token before the trial; the gain is relative to it
    margin: float | None = None  # max(noise, min_margin): the gain needed to adopt
    gain: float | None = None  # 1 - canary s_per_token / siblings' s_per_token


Evidence = (DriftEvidence | CapacityEvidence | PlanEvidence | RecompileEvidence | StepEvidence | VerifyEvidence
            | RollbackEvidence | CompileEvidence | CompiledEvidence | RebalanceEvidence | CanaryEvidence)

KIND_TO_RECORD: dict[str, type[Evidence]] = {
    record.kind: record
    for record in (DriftEvidence, PlanEvidence, StepEvidence, VerifyEvidence, RollbackEvidence, RecompileEvidence,
                   CapacityEvidence, CompileEvidence, CompiledEvidence, RebalanceEvidence, CanaryEvidence)
}
KINDS = tuple(KIND_TO_RECORD)
_KIND_TO_HINTS = {kind: get_type_hints(record) for kind, record in KIND_TO_RECORD.items()}


def from_json(kind: str, evidence: object) -> Evidence | None:
    """The record a logged ``evidence`` object of ``kind`` holds, or None when it holds none (see the module doc)."""
    record = KIND_TO_RECORD.get(kind)
    if record is None or not isinstance(evidence, Mapping):
        return None
    hints = _KIND_TO_HINTS[kind]
    values: dict[str, Any] = {}
    for f in fields(record):
        raw = evidence.get(f.name)
        optional = f.default is None
        if f.name not in evidence or (raw is None and optional):
            if not optional:
                return None
            continue
        try:
            values[f.name] = _read(raw, hints[f.name])
        except _Unfit:
            return None
    return record(**values)


class _Unfit(Exception):
    """A logged value that does not fit its field's type."""


def _read(value: object, hint: Any) -> Any:
    origin, args = get_origin(hint), get_args(hint)
    if hint is Any:
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is not type(None):
                try:
                    return _read(value, arg)
                except _Unfit:
                    pass
        raise _Unfit
    if hint is float:
        if value is None:
            return math.inf
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise _Unfit
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise _Unfit
    if hint in (str, bool):
        if isinstance(value, hint):
            return value
        raise _Unfit
    if origin is tuple and isinstance(value, (list, tuple)):
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_read(item, args[0]) for item in value)
        if len(args) == len(value):
            return tuple(_read(item, arg) for item, arg in zip(value, args, strict=True))
        raise _Unfit
    if origin is dict and isinstance(value, dict):
        return {str(key): _read(item, args[1]) for key, item in value.items()}
    raise _Unfit


def _plain(value: object) -> Any:
    """A field's value as JSON: tuples become lists."""
    if isinstance(value, (tuple, list)):
        return [_plain(item) for item in value]
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    return value
