"""The control loop: sense -> decide -> act -> verify, one ``tick(now, slots)`` at a time.

Each tick reads the telemetry window. With no rollout in progress it asks the drift detector whether
the live mix has left the mix the current plan was made for; on drift it re-plans (pool options from
the capacity model for the live mix, the planner with the move cost) and turns the diff into steps.
A step is carried out by a ``Mover`` through the ``Actuator``; ``verify_after_s`` after its last move
is routable, the observed goodput is compared with the plan's prediction and with the goodput before
the step, and a step that is worse than both beyond ``verify_margin`` is rolled back (moves reversed)
with an exponential back-off before the next plan. Every decision is returned (and logged by the caller).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from fleet.capacity import CapacityModel
from fleet.decisions import Decision, Move, decision
from fleet.drift import DriftDetector, DriftSettings
from fleet.options import MoveCost, Options, pool_options, problem_for
from fleet.planner import Plan, evaluate, fill_budget, plan
from fleet.rollout import Actuator, Mover, SlotState, batch_moves, diff_moves
from fleet.telemetry import Telemetry, TrafficMix
from fleet.tiers import DEFAULT_TIERS, TierSlo
from kernels.config import EngineConfig


@dataclass(frozen=True, slots=True)
class ControllerSettings:
    model: str
    gpu_to_budget: Mapping[str, int]
    tiers: Mapping[str, TierSlo] = field(default_factory=lambda: dict(DEFAULT_TIERS))
    drift: DriftSettings = field(default_factory=DriftSettings)
    move_cost: MoveCost = field(default_factory=MoveCost)
    plan_horizon_s: float = 900.0  # how long a plan is expected to hold (amortises move cost)
    max_step_fraction: float = 0.25
    verify_after_s: float = 45.0
    verify_margin: float = 0.15
    backoff_s: float = 300.0

    def __post_init__(self) -> None:
        if not 0 < self.max_step_fraction <= 1:
            raise ValueError("max_step_fraction must be in (0, 1]")
        if self.verify_margin < 0 or self.plan_horizon_s <= 0:
            raise ValueError("verify_margin must be >= 0 and plan_horizon_s > 0")


@dataclass(slots=True)
class _Rollout:
    plan: Plan
    options: Options
    steps: list[tuple[Move, ...]]
    mover: Mover | None = None
    current: tuple[Move, ...] = ()
    step_done_at: float | None = None
    goodput_before_rps: float = 0.0
    healthy_before: bool = True  # the fleet met (1 - margin) of its demand before the step
    slot_to_old_config: dict[str, str] = field(default_factory=dict)
    rolling_back: bool = False


class Controller:
    def __init__(
        self,
        settings: ControllerSettings,
        telemetry: Telemetry,
        capacity: CapacityModel,
        actuator: Actuator,
        reference_mix: TrafficMix,
    ) -> None:
        self.settings = settings
        self.telemetry = telemetry
        self.capacity = capacity
        self.actuator = actuator
        self.reference_mix = reference_mix
        self.detector = DriftDetector(settings.drift)
        self._rollout: _Rollout | None = None
        self._backoff_until = -math.inf
        self._num_failures = 0
        self.num_repartitions = 0
        self.num_recompiles = 0
        self.options: Options | None = None  # the latest pool options (for the router's saturation limits)

    @property
    def busy(self) -> bool:
        return self._rollout is not None

    def tick(self, now: float, slots: list[SlotState]) -> list[Decision]:
        if self._rollout is not None:
            return self._advance(now, slots)
        if now < self._backoff_until:
            return []
        live = self.telemetry.window(now)
        current, verdict = self.detector.observe(now, live, self.reference_mix, self.telemetry.covered_s(now))
        if verdict is None:
            return []
        out = [decision(now, "drift", reason=current.reason, score=round(current.score, 3),
                        divergence=round(current.divergence, 4), rate_change=round(current.rate_change, 4),
                        profile_change=round(current.profile_change, 4), dwell_since=verdict.above_since,
                        mix_before=self.reference_mix.to_json(), mix_after=live.to_json())]
        # plan for the traffic since the change began, not the whole window (mostly the old mix)
        recent = self.telemetry.window(now, max(self.telemetry.bucket_s, now - verdict.above_since))
        return out + self._replan(now, recent if recent.shapes else live, slots)

    def _replan(self, now: float, live: TrafficMix, slots: list[SlotState]) -> list[Decision]:
        s = self.settings
        gpus = tuple(sorted(s.gpu_to_budget))
        options = pool_options(live.shapes, gpus, self.capacity, s.tiers)
        self.options = options
        counts: dict[str, int] = {}
        for slot in slots:
            counts[slot.pool] = counts.get(slot.pool, 0) + 1
        move_s = s.move_cost.drain_s + s.move_cost.restart_s(s.model, gpus[0], EngineConfig())
        problem = problem_for(options, (live,), s.gpu_to_budget, counts, move_s, s.plan_horizon_s)
        new_plan = plan(problem)
        self.reference_mix = live
        self.detector.on_plan(now)
        if new_plan is None:
            return [decision(now, "plan", outcome="infeasible", budget=dict(s.gpu_to_budget))]
        new_plan = fill_budget(problem, new_plan)
        before = evaluate(problem, counts)
        pool_to_gpu = {p.name: p.gpu for p in options.pools}
        moves = diff_moves(slots, new_plan.replicas(), pool_to_gpu, options.configs_json())
        # capacity goes where the demand moved first; in-place recompiles (a tuning) come last
        moves.sort(key=lambda m: m.from_pool == m.to_pool)
        diff = {p: [counts.get(p, 0), n] for p, n in new_plan.pool_to_num_replicas if counts.get(p, 0) != n}
        out = [decision(now, "plan", outcome="apply" if moves else "keep", diff=diff,
                        predicted_goodput_before_rps=round(before.predicted_goodput_rps, 3),
                        predicted_goodput_after_rps=round(new_plan.predicted_goodput_rps, 3),
                        objective_before=round(before.objective, 4), objective_after=round(new_plan.objective, 4),
                        configs=options.configs_json(), num_moves=len(moves))]
        recompiled = [m for m in moves if m.from_pool == m.to_pool]
        if recompiled:
            out.append(decision(now, "recompile", moves=tuple(recompiled), reason="the shape's length profile changed its best configuration"))
            self.num_recompiles += len(recompiled)
        if not moves:
            return out
        self.num_repartitions += 1
        old = {slot.slot: slot.config_json for slot in slots}
        steps = batch_moves(moves, len(slots), s.max_step_fraction)
        self._rollout = _Rollout(new_plan, options, steps, slot_to_old_config=old)
        return out + self._start_step(now)

    def _start_step(self, now: float) -> list[Decision]:
        rollout = self._rollout
        assert rollout is not None and rollout.steps
        rollout.current = rollout.steps.pop(0)
        before = self.telemetry.window(now, self.settings.verify_after_s)
        rollout.goodput_before_rps = before.goodput_rps()
        rollout.healthy_before = rollout.goodput_before_rps >= (1 - self.settings.verify_margin) * before.total_rate_rps
        rollout.mover = Mover(self.actuator, rollout.current, now)
        rollout.step_done_at = None
        return [decision(now, "step", moves=rollout.current, num_steps_left=len(rollout.steps),
                         goodput_before_rps=round(rollout.goodput_before_rps, 3))]

    def _advance(self, now: float, slots: list[SlotState]) -> list[Decision]:
        rollout = self._rollout
        assert rollout is not None and rollout.mover is not None
        rollout.mover.advance(now)
        if not rollout.mover.done:
            return []
        if rollout.step_done_at is None:
            rollout.step_done_at = now
        # an overloaded fleet cannot be judged by one step (see below): it moves on at restart speed
        wait_s = self.settings.verify_after_s if rollout.healthy_before else 0.0
        if now - rollout.step_done_at < wait_s:
            return []
        if rollout.rolling_back:
            self._rollout = None
            return []
        live = self.telemetry.window(now, self.settings.verify_after_s)
        options = rollout.options
        counts: dict[str, int] = {}
        for slot in slots:
            counts[slot.pool] = counts.get(slot.pool, 0) + 1
        predicted = evaluate(problem_for(options, (live,), self.settings.gpu_to_budget), counts).predicted_goodput_rps
        observed = live.goodput_rps()
        floor = (1 - self.settings.verify_margin) * min(predicted, rollout.goodput_before_rps)
        # A fleet that was already missing its demand before the step carries a backlog that drags
        # the observed goodput down whatever the step did: rolling back would return to the failing
        # plan, so the step is judged inconclusive and the rollout goes on.
        ok = bool(observed >= floor) or not rollout.healthy_before
        out = [decision(now, "verify", ok=ok, observed_goodput_rps=round(observed, 3),
                        predicted_goodput_rps=round(predicted, 3), goodput_before_rps=round(rollout.goodput_before_rps, 3),
                        healthy_before=rollout.healthy_before, margin=self.settings.verify_margin)]
        if ok:
            self._num_failures = 0
            if rollout.steps:
                return out + self._start_step(now)
            self._rollout = None
            return out
        return out + self._roll_back(now, rollout)

    def _roll_back(self, now: float, rollout: _Rollout) -> list[Decision]:
        self._num_failures += 1
        backoff = self.settings.backoff_s * 2 ** (self._num_failures - 1)
        self._backoff_until = now + backoff
        undo = tuple(m.reversed(rollout.slot_to_old_config[m.slot]) for m in rollout.current)
        rollout.steps = []
        rollout.rolling_back = True
        rollout.mover = Mover(self.actuator, undo, now)
        rollout.step_done_at = None
        return [decision(now, "rollback", moves=undo, reason="observed goodput below prediction and below the goodput before the step",
                         backoff_s=backoff, plan_failed=True)]


def initial_slots(plan_counts: Mapping[str, int], options: Options) -> list[SlotState]:
    """Slots named ``<gpu>/<k>`` for a fresh deployment of ``plan_counts``."""
    pool_to_gpu = {p.name: p.gpu for p in options.pools}
    configs = options.configs_json()
    gpu_to_next: dict[str, int] = {}
    slots = []
    for pool, n in sorted(plan_counts.items()):
        gpu = pool_to_gpu[pool]
        for _ in range(n):
            k = gpu_to_next.get(gpu, 0)
            gpu_to_next[gpu] = k + 1
            slots.append(SlotState(f"{gpu}/{k}", pool, gpu, configs[pool]))
    return slots

