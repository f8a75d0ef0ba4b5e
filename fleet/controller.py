"""The control loop: sense -> decide -> act -> verify, one ``tick(now, slots)`` at a time.

The controller decides and never acts: ``tick`` takes the edge's snapshot (``slots``: where each
replica serves, whether it is alive, healthy, and how many requests it holds) and returns a
``TickOutput``, the decisions to log and the commands (fleet.commands) for the edge to apply before
it takes the next snapshot. Each tick reads the telemetry window. With no rollout in progress it asks the drift detector whether
the live mix has left the mix the current plan was made for; on drift it re-plans (pool options from
the capacity model for the live mix: the operator's declared pools under their own names, and a
``<shape>@<gpu>`` pool only for a shape no declared pool on that GPU kind serves; the planner with the
move cost) and turns the diff into steps, so a mix the declared pools fit keeps them. That plan comes from
the short sample since the change began, so it only moves replicas between pools; once the window holds only
the new mix it plans again (``refine``), and only then restarts replicas in place for faster configurations.
A plan from a full sample whose predicted gain is within that sample's counting noise keeps the fleet.
Those recompiles tune for the mix they were planned for: a drift found while only they are left ends the
rollout after its current step and is planned for at once.
A step is planned by a ``Mover``, whose commands the edge applies; ``verify_after_s`` after its last move
is routable, the observed goodput is compared with the plan's prediction and with the goodput before
the step, and a step that is worse than both beyond ``verify_margin`` and the window's counting noise
(``counting_noise_rps``) is rolled back (moves reversed)
with an exponential back-off before the next plan. A step whose replica is not healthy within the
start deadline is rolled back the same way ("replica never became healthy"). Slots whose replica is
gone (``SlotState.alive`` false) leave the GPU budget the planner allocates: a ``capacity`` decision
records the change and the next plan is made for the GPUs that are left. Every decision is returned
(and logged by the caller).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from fleet.canary_trial import CanaryTrials
from fleet.capacity import CapacityModel
from fleet.commands import Command, TickOutput
from fleet.compiled import ConfigSource, compile_ready, compile_submitted
from fleet.decisions import Decision, Move
from fleet.drift import DriftDetector, DriftSettings, DriftVerdict
from fleet.evidence import CapacityEvidence, DriftEvidence, PlanEvidence, RecompileEvidence, RollbackEvidence, StepEvidence, VerifyEvidence
from fleet.foreign_load import ForeignLoad, discounted, foreign_shares
from fleet.incumbents import restart_margin, running_configs
from fleet.options import DeclaredPool, MoveCost, Options, pool_options, problem_for
from fleet.planner import Plan, allows, evaluate, fill_budget, plan
from fleet.rollout import Mover, SlotState, batch_moves, diff_moves, rolling_batches
from fleet.telemetry import Telemetry, TrafficMix
from kernels.config import EngineConfig
from kernels.engine_servers import EngineServer
from kernels.tiers import DEFAULT_TIERS, TierSlo


@dataclass(frozen=True, slots=True)
class ControllerSettings:
    model: str
    gpu_to_budget: Mapping[str, int]
    tiers: Mapping[str, TierSlo] = field(default_factory=lambda: dict(DEFAULT_TIERS))
    # the operator's pools: the starting plan, kept under their own names while they fit the mix
    declared: tuple[DeclaredPool, ...] = ()
    pool_prefix: str = ""  # prefixes the names of the pools it makes (fleet.options.pool_name): "<model>:" beside other models
    # how the engine its pools run on each GPU kind runs a configuration, where not as sglang does
    # (kernels.engine_servers: llama-server, vLLM), judged so (fleet.options.pool_options)
    made_engines: Mapping[str, EngineServer] = field(default_factory=dict)
    drift: DriftSettings = field(default_factory=DriftSettings)
    move_cost: MoveCost = field(default_factory=MoveCost)
    plan_horizon_s: float = 900.0  # how long a plan is expected to hold (amortises move cost)
    # A plan serves the demand of each span of this length in its sample, not the sample's mean: capacity
    # that only a burst uses counts for that burst's span.
    plan_span_s: float = 30.0
    max_step_fraction: float = 0.25
    # the bound for moves between pools while the fleet misses its demand (see _replan)
    failing_step_fraction: float = 0.5
    verify_after_s: float = 45.0
    verify_margin: float = 0.15
    # A moved replica whose engine holds more than this share of the plan's per-replica concurrency waiting
    # in its own queue, while the gateway kept within that concurrency there, fails its step (_engine_backlog).
    verify_engine_backlog: float = 0.5
    # With the mix steady, a pool's foreign share (fleet.foreign_load) that moved this far from the one the
    # current plan was made with calls for a plan of its own (after drift.min_interval_s, like a drift).
    foreign_replan_change: float = 0.2
    backoff_s: float = 300.0
    drain_timeout_s: float = 300.0  # past it a draining slot is stopped anyway: its requests end with a clear error
    start_timeout_s: float | None = None  # a start not healthy by then fails the step; None: the margin below
    start_timeout_margin: float = 4.0  # x the MoveCost restart time of the slowest GPU kind
    # The least time a start gets, in fleet seconds: a live fleet's process start (imports, a Ray actor) is
    # wall time the emulator's speed does not shorten (gateway.live_fleet sets it; the simulator starts nothing).
    min_start_timeout_s: float = 0.0

    def __post_init__(self) -> None:
        if not (0 < self.max_step_fraction <= 1 and 0 < self.failing_step_fraction <= 1):
            raise ValueError("max_step_fraction and failing_step_fraction must be in (0, 1]")
        if self.verify_margin < 0 or self.plan_horizon_s <= 0 or self.verify_engine_backlog <= 0 or self.foreign_replan_change <= 0:
            raise ValueError("verify_margin must be >= 0, plan_horizon_s, verify_engine_backlog and foreign_replan_change > 0")
        if self.drain_timeout_s <= 0 or self.start_timeout_margin <= 0 or (self.start_timeout_s is not None and self.start_timeout_s <= 0):
            raise ValueError("drain_timeout_s, start_timeout_s and start_timeout_margin must be > 0")


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
    drift: DriftVerdict | None = None  # found while only in-place recompiles were left (_observe_while_tuning)


class Controller:
    def __init__(
        self,
        settings: ControllerSettings,
        telemetry: Telemetry,
        capacity: CapacityModel,
        reference_mix: TrafficMix,
        configs: ConfigSource | None = None,
        canary: CanaryTrials | None = None,
    ) -> None:
        self.settings = settings
        self.configs = configs  # compiled configurations (fleet.compiled); None: the fixed candidates only
        self.telemetry = telemetry
        self.capacity = capacity
        self.reference_mix = reference_mix
        self.detector = DriftDetector(settings.drift)
        self._rollout: _Rollout | None = None
        self._backoff_until = -math.inf
        self._num_failures = 0
        self.num_repartitions = 0
        self.num_recompiles = 0
        self.options: Options | None = None  # the latest pool options (for the router's saturation limits)
        self._dead: dict[str, str] = {}  # slot -> GPU kind, of the slots whose replica is gone
        self._capacity_changed = False  # the dead set changed since the last plan
        self._commands: list[Command] = []  # this tick's, in the order the edge applies them
        self._slots: dict[str, SlotState] = {}  # this tick's snapshot, by slot name
        self.foreign = ForeignLoad(telemetry.window_s)  # the engines' load beyond the gateway's, over the telemetry window
        self._planned_shares: dict[str, float] = {}  # the foreign shares the current plan was made with
        # A drift plan is made from the traffic since the change began: fast, but a short sample. Once the
        # telemetry window holds only the new mix the fleet is planned again (the planner weighs any further
        # move against its cost). Stretched drift-step at 36 req/s: the 30 s sample's plan held 70% of the
        # SLO after the change, a 120 s sample's 78% (fleet/README.md "Capacity at SLO").
        self._refine_at: float | None = None
        s = settings
        self.start_timeout_s = s.start_timeout_s or max(s.min_start_timeout_s, s.start_timeout_margin * max(
            (s.move_cost.restart_s(s.model, gpu, EngineConfig()) for gpu in s.gpu_to_budget), default=60.0))
        # given (fleet.controller.canary.enabled, where the edge records each replica's outcomes): an in-place
        # recompile of a pool of two or more replicas trials one of them first; the rest follow if it is adopted
        self._canary = canary
        self._canary_queue: list[tuple[str, str]] = []  # (pool, config JSON) recompiles waiting for their trial

    def budget(self) -> dict[str, int]:
        """GPU slots the planner may allocate: the configured budget less the slots that are gone."""
        dead_per_gpu: dict[str, int] = {}
        for gpu in self._dead.values():
            dead_per_gpu[gpu] = dead_per_gpu.get(gpu, 0) + 1
        return {gpu: max(0, n - dead_per_gpu.get(gpu, 0)) for gpu, n in self.settings.gpu_to_budget.items()}

    @property
    def busy(self) -> bool:
        return self._rollout is not None or self._canary is not None and (self._canary.busy or bool(self._canary_queue))

    def backing_off(self, now: float) -> bool:
        """A rolled-back plan's back-off runs: no plan is made before it ends."""
        return now < self._backoff_until

    def set_budget(self, gpu_to_budget: Mapping[str, int]) -> None:
        """A slot moved between models (fleet.rebalance): the next tick plans for the new budget, as after a
        capacity change, and a slot it now owns in another model's pool is moved into one of its own."""
        self.settings = replace(self.settings, gpu_to_budget=dict(gpu_to_budget))
        self._capacity_changed = True

    def tick(self, now: float, slots: list[SlotState]) -> TickOutput:
        self._commands = []
        self._slots = {s.slot: s for s in slots}
        self.foreign.observe(now, slots)
        decisions = self._decide(now, slots)
        return TickOutput(decisions, self._commands)

    def _decide(self, now: float, slots: list[SlotState]) -> list[Decision]:
        out = self._note_dead(now, slots)
        if self._rollout is not None:
            return out + self._advance(now, slots)
        if self._canary is not None and (self._canary.busy or self._canary_queue):
            return out + self._advance_canary(now, slots)
        if now < self._backoff_until:
            return out
        if self.configs is not None:
            adopted = self._adopt_compiled(now, slots)
            if adopted:
                return out + adopted
        live = self.telemetry.window(now)
        if self._refine_at is not None and now >= self._refine_at:
            self._refine_at = None
            return out + self._replan(now, live, slots, trigger="refine", windows=self._spans(now, live))
        current, verdict = self.detector.observe(now, live, self.reference_mix, self.telemetry.covered_s(now), self._surge_span(now))
        if verdict is None:
            # same traffic, fewer (or more) GPUs: plan again for what is left (once there is traffic to plan for)
            if not (live.shapes or self.reference_mix.shapes) or not (self._capacity_changed or self._foreign_changed(now)):
                return out
            trigger = None if self._capacity_changed else "foreign load"
            if live.shapes:
                return out + self._replan(now, live, slots, trigger=trigger, windows=self._spans(now, live))
            return out + self._replan(now, self.reference_mix, slots, trigger=trigger)
        return out + self._on_drift(now, live, verdict, slots)

    def _on_drift(self, now: float, live: TrafficMix, verdict: DriftVerdict, slots: list[SlotState],
                  tuning_dropped: int | None = None) -> list[Decision]:
        """Log the drift and plan for it; ``tuning_dropped``: the in-place recompiles it cancelled."""
        current = verdict.score
        out = [Decision(now, DriftEvidence(reason=current.reason, score=round(current.score, 3),
                        divergence=round(current.divergence, 4), rate_change=round(current.rate_change, 4),
                        profile_change=round(current.profile_change, 4), dwell_since=verdict.above_since,
                        mix_before=self.reference_mix.to_json(), mix_after=live.to_json(), tuning_dropped=tuning_dropped))]
        # plan for the traffic since the change began, not the whole window (mostly the old mix)
        recent = self.telemetry.window(now, max(self.telemetry.bucket_s, now - verdict.above_since))
        refine_at = verdict.above_since + self.telemetry.window_s
        short_sample = refine_at > now  # the window still holds some of the old mix
        sample = recent if recent.shapes else live
        out += self._replan(now, sample, slots, tune=not short_sample, windows=self._spans(now, sample))
        self._refine_at = refine_at if short_sample else None
        return out

    def _surge_span(self, now: float) -> TrafficMix:
        """The last ``strong_dwell_s`` (at least one telemetry bucket), where a surge of the rate shows first."""
        return self.telemetry.window(now, max(self.telemetry.bucket_s, self.detector.settings.strong_dwell_s))

    def _observe_while_tuning(self, now: float, rollout: _Rollout) -> None:
        """While the rollout has only in-place recompiles left (tuning, not capacity), the drift detector
        keeps watching; a drift it finds ends the rollout after the current step (``_advance``). Stretched
        drift-ramp at 1.09x: the refine's four rolling recompiles ran 755-1085 s while the ramp went on,
        and the drift they held back moved two of the just-recompiled replicas at 1120 s; cancelled at
        980 s, that draw's worst gate went from 91.5% to 94.5%; the capacity searches' draws met no such
        overlap and did not change (fleet/README.md "Capacity at SLO")."""
        if rollout.rolling_back or rollout.drift is not None or not rollout.steps:
            return
        if any(m.from_pool != m.to_pool for step in (rollout.current, *rollout.steps) for m in step):
            return
        live = self.telemetry.window(now)
        rollout.drift = self.detector.observe(now, live, self.reference_mix, self.telemetry.covered_s(now), self._surge_span(now))[1]

    def _adopt_compiled(self, now: float, slots: list[SlotState]) -> list[Decision]:
        """Log the compiles finished since the last tick for the pools they serve; when the current
        options waited for one that changes a pool's configuration, plan again for the same mix."""
        assert self.configs is not None
        options, out, replan = self.options, [], False
        for found in self.configs.ready(now):
            if options is None:
                continue
            configs = dict(options.pool_to_config)
            for pool in options.pools_for(found.gpu, found.envelope):
                out.append(compile_ready(now, pool, found, configs.get(pool)))
                replan = replan or (options.awaiting(pool) and configs.get(pool) != found.config)
        return out + self._replan(now, self.reference_mix, slots) if replan else out

    def _note_dead(self, now: float, slots: list[SlotState]) -> list[Decision]:
        """A ``capacity`` decision when slots die or come back; the next plan uses the new budget."""
        dead = {s.slot: s.gpu for s in slots if not s.alive}
        if dead.keys() == self._dead.keys():
            return []
        lost, back = sorted(dead.keys() - self._dead.keys()), sorted(self._dead.keys() - dead.keys())
        self._dead = dead
        self._capacity_changed = True
        return [Decision(now, CapacityEvidence(lost=tuple(lost), recovered=tuple(back), budget=self.budget(),
                         reason="replica process gone or ejected: its GPUs leave the budget the planner allocates"
                         if lost else "replicas are back: their GPUs return to the budget"))]

    def _foreign_changed(self, now: float) -> bool:
        """A pool's foreign share moved by ``foreign_replan_change`` since the current plan was made."""
        if self.options is None or now - self.detector.last_plan_at < self.settings.drift.min_interval_s:
            return False
        shares, planned = foreign_shares(self.options, self.foreign.per_replica(now)), self._planned_shares
        return any(abs(shares.get(pool, 0.0) - planned.get(pool, 0.0)) >= self.settings.foreign_replan_change
                   for pool in shares.keys() | planned.keys())

    def _spans(self, now: float, sample: TrafficMix) -> tuple[TrafficMix, ...]:
        """``sample`` (the telemetry's last ``sample.window_s``) as its consecutive ``plan_span_s`` spans."""
        return self.telemetry.windows(now, sample.window_s, self.settings.plan_span_s)

    def _replan(self, now: float, live: TrafficMix, slots: list[SlotState], trigger: str | None = None,
                tune: bool = True, windows: tuple[TrafficMix, ...] | None = None) -> list[Decision]:
        """Plan for ``live`` and start the rollout: its lengths size the pools, and the demand the plan
        serves is ``windows``' (``live``'s spans, so that a burst counts as a burst), else ``live``'s mean.
        ``tune=False`` (a plan from a short sample) moves replicas between pools but restarts none in place
        for a faster configuration: that waits for the refined plan, whose sample shows the new lengths."""
        s = self.settings
        self._capacity_changed = False
        slots = [slot for slot in slots if slot.alive]  # a dead slot can neither serve nor move
        budget = self.budget()
        gpus = tuple(sorted(budget))
        move_s = s.move_cost.drain_s + s.move_cost.restart_s(s.model, gpus[0], EngineConfig())
        options = pool_options(live.shapes, gpus, self.capacity, s.tiers, self.configs, now, self.options, s.declared, s.pool_prefix,
                               running_configs(slots), restart_margin(move_s, s.plan_horizon_s) if tune else math.inf, s.made_engines)
        self.options = options
        asked = [compile_submitted(now, a.pool, a.gpu, a.envelope, a.previous) for a in options.submitted if a.new]
        counts: dict[str, int] = {}
        for slot in slots:
            counts[slot.pool] = counts.get(slot.pool, 0) + 1
        # the planner credits a replica only with the capacity its engine's foreign load leaves the gateway;
        # self.options keeps the full rates: the router counts the foreign requests itself
        shares = foreign_shares(options, self.foreign.per_replica(now))
        planned = discounted(options, shares)
        self._planned_shares = shares
        problem = problem_for(planned, windows or (live,), budget, counts, move_s, s.plan_horizon_s)
        new_plan = plan(problem)
        self.reference_mix = live
        self.detector.on_plan(now)
        if new_plan is None:
            return asked + [Decision(now, PlanEvidence(outcome="infeasible", budget=budget, foreign_share=_rounded(shares), trigger=trigger))]
        found = fill_budget(problem, new_plan)
        before = evaluate(problem, counts)
        diff = {p: (counts.get(p, 0), n) for p, n in found.pool_to_num_replicas if counts.get(p, 0) != n}
        # A gain the sample's counting noise could fake is no evidence of a gain, and the moves cost drains and
        # restarts: tenant-mix's bursty batch tenant gave each 120 s sample another mix, and its refine moved
        # a batch H100 for a predicted 0.135 req/s (noise about 1 req/s); keeping such plans took its x1 worst
        # gate from 80.9% to 96.2% (fleet/README.md "Gains inside the noise keep the fleet"). A drift's short
        # sample (tune=False) is exempt, whatever its gain: the detector has already judged that the mix moved, and
        # the objective weighs headroom too, so its plan may trade the sample's last old-mix requests for headroom
        # (a goodput gain of 0 or below: tests/gateway/test_real_drift.py's drift plan was declined so).
        noise = counting_noise_rps(before.predicted_goodput_rps, live.window_s)
        declined = tune and bool(diff) and allows(problem, counts) and found.predicted_goodput_rps - before.predicted_goodput_rps < noise
        new_plan = before if declined else found
        pool_to_gpu = {p.name: p.gpu for p in options.pools}
        moves = diff_moves(slots, new_plan.replicas(), pool_to_gpu, options.configs_json())
        # capacity goes where the demand moved first; in-place recompiles (a tuning) come last
        moves.sort(key=lambda m: m.from_pool == m.to_pool)
        out = asked + [Decision(now, PlanEvidence(outcome="apply" if moves else "keep", diff={} if declined else diff,
                        budget=budget, predicted_goodput_before_rps=round(before.predicted_goodput_rps, 3),
                        predicted_goodput_after_rps=round(found.predicted_goodput_rps, 3),
                        objective_before=round(before.objective, 4), objective_after=round(found.objective, 4),
                        configs=options.configs_json(), num_moves=len(moves), foreign_share=_rounded(shares),
                        trigger=trigger, declined=diff if declined else None, noise_rps=round(noise, 3) if declined else None))]
        recompiled = [m for m in moves if m.from_pool == m.to_pool]
        if recompiled:
            out.append(Decision(now, RecompileEvidence(reason="the shape's length profile changed its best configuration"), tuple(recompiled)))
            self.num_recompiles += len(recompiled)
            recompiled = self._queue_canaries(recompiled, slots)
            moves = [m for m in moves if m.from_pool != m.to_pool] + recompiled
        if not moves:
            return out + (self._advance_canary(now, slots) if self._canary_queue else [])
        self.num_repartitions += 1
        old = {slot.slot: slot.config_json for slot in slots}
        # A fleet already missing its demand cannot judge a step (its verification is skipped, see
        # _advance), and the replicas that move leave pools whose demand has left: small steps buy no
        # safety there, only a longer overload. Moves between pools then go in steps of
        # failing_step_fraction; in-place recompiles (tuning a pool that keeps its demand) keep the bound and
        # restart one replica of a pool at a time.
        recent = self.telemetry.window(now, s.verify_after_s)
        failing = recent.goodput_rps() < (1 - s.verify_margin) * recent.total_rate_rps
        moving = [m for m in moves if m.from_pool != m.to_pool]
        steps = (batch_moves(moving, len(slots), s.failing_step_fraction if failing else s.max_step_fraction)
                 + rolling_batches(recompiled, len(slots), s.max_step_fraction))
        self._rollout = _Rollout(new_plan, planned, steps, slot_to_old_config=old)  # verify predicts with the discount
        return out + self._start_step(now)

    def _queue_canaries(self, recompiled: list[Move], slots: list[SlotState]) -> list[Move]:
        """With canaries on: each pool whose two or more replicas all recompile to one configuration waits for its
        trial (queued, one pool at a time after the rollout); the other recompiles stay steps."""
        if self._canary is None:
            return recompiled
        by_pool: dict[str, list[Move]] = {}
        for move in recompiled:
            by_pool.setdefault(move.to_pool, []).append(move)
        left: list[Move] = []
        for pool, pool_moves in by_pool.items():
            members = {s.slot for s in slots if s.pool == pool}
            if len(members) >= 2 and members == {m.slot for m in pool_moves} and len({m.config_json for m in pool_moves}) == 1:
                self._canary_queue.append((pool, pool_moves[0].config_json))
            else:
                left += pool_moves
        return left

    def _advance_canary(self, now: float, slots: list[SlotState]) -> list[Decision]:
        """The running trial's next tick, or the next queued pool's trial; a rolled-back canary backs off as a failed step."""
        assert self._canary is not None
        rolled_back = self._canary.num_rolled_back
        if self._canary.busy:
            out = self._canary.tick(now, slots)
        else:
            pool, config_json = self._canary_queue.pop(0)
            try:
                out = self._canary.request(now, slots, pool, config_json)
            except ValueError:  # MoveRefused: the pool changed since the plan (a slot died); its replicas keep their configuration
                return []
        self._commands += out.commands
        if self._canary.num_rolled_back > rolled_back:
            self._back_off(now)
            self._canary_queue.clear()  # the plan these came from is not what runs now
        return out.decisions

    def _start_step(self, now: float) -> list[Decision]:
        rollout = self._rollout
        assert rollout is not None and rollout.steps
        rollout.current = rollout.steps.pop(0)
        before = self.telemetry.window(now, self.settings.verify_after_s)
        rollout.goodput_before_rps = before.goodput_rps()
        rollout.healthy_before = rollout.goodput_before_rps >= (1 - self.settings.verify_margin) * before.total_rate_rps
        rollout.mover = self._mover(rollout.current, now)
        rollout.step_done_at = None
        self._commands += rollout.mover.advance(now, self._slots)  # the drains
        return [Decision(now, StepEvidence(num_steps_left=len(rollout.steps), goodput_before_rps=round(rollout.goodput_before_rps, 3)),
                         rollout.current)]

    def _mover(self, moves: tuple[Move, ...], now: float) -> Mover:
        return Mover(moves, now, self.settings.drain_timeout_s, self.start_timeout_s)

    def _advance(self, now: float, slots: list[SlotState]) -> list[Decision]:
        rollout = self._rollout
        assert rollout is not None and rollout.mover is not None
        mover = rollout.mover
        self._commands += mover.advance(now, self._slots)
        self._observe_while_tuning(now, rollout)
        if not mover.done:
            return []
        if mover.failed and not rollout.rolling_back:
            return self._roll_back(now, rollout, "replica never became healthy", never_healthy=tuple(m.slot for m in mover.failed),
                                   start_timeout_s=round(self.start_timeout_s, 3))
        if rollout.step_done_at is None:
            rollout.step_done_at = now
        # an overloaded fleet cannot be judged by one step (see below): it moves on at restart speed
        wait_s = self.settings.verify_after_s if rollout.healthy_before else 0.0
        if now - rollout.step_done_at < wait_s:
            return []
        if rollout.rolling_back:
            self._rollout = None
            if mover.failed:  # the slot is left out of service; the next plan sees it when it is reported dead
                return [Decision(now, RollbackEvidence(outcome="failed", reason="the previous configuration never became healthy either"),
                                 mover.failed)]
            return []
        live = self.telemetry.window(now, self.settings.verify_after_s)
        options = rollout.options
        counts: dict[str, int] = {}
        for slot in slots:
            if slot.alive:
                counts[slot.pool] = counts.get(slot.pool, 0) + 1
        predicted = evaluate(problem_for(options, (live,), self.budget()), counts).predicted_goodput_rps
        observed = live.goodput_rps()
        floor = (1 - self.settings.verify_margin) * min(predicted, rollout.goodput_before_rps)
        noise = counting_noise_rps(floor, live.window_s)
        # A fleet that was already missing its demand before the step carries a backlog that drags
        # the observed goodput down whatever the step did: rolling back would return to the failing
        # plan, so the step is judged inconclusive and the rollout goes on.
        goodput_ok = bool(observed >= floor - noise) or not rollout.healthy_before
        waiting, backlogged = self._engine_backlog(rollout)
        ok = goodput_ok and not backlogged
        out = [Decision(now, VerifyEvidence(ok=ok, observed_goodput_rps=round(observed, 3),
                        predicted_goodput_rps=round(predicted, 3), goodput_before_rps=round(rollout.goodput_before_rps, 3),
                        healthy_before=rollout.healthy_before, margin=self.settings.verify_margin, noise_rps=round(noise, 3),
                        drain_deadline_stops=tuple(mover.forced_stops), engine_waiting=waiting or None,
                        engine_backlogged=backlogged or None))]
        if ok:
            self._num_failures = 0
            if rollout.drift is not None:  # the mix moved on: the remaining recompiles tune for the old one
                self._rollout = None
                return out + self._on_drift(now, self.telemetry.window(now), rollout.drift, slots,
                                            tuning_dropped=sum(map(len, rollout.steps)))
            if rollout.steps:
                return out + self._start_step(now)
            self._rollout = None
            return out
        reason = ("observed goodput below prediction and below the goodput before the step" if not goodput_ok
                  else "the moved replicas' engines queue requests the plan said they run")
        return out + self._roll_back(now, rollout, reason)

    def _engine_backlog(self, rollout: _Rollout) -> tuple[tuple[tuple[str, int, int], ...], tuple[str, ...]]:
        """Each moved replica's engine queue as this tick's snapshot has it (slot, waiting, the gateway's in
        flight there), and the replicas backlogged: their engine holds more than ``verify_engine_backlog`` of
        the plan's per-replica concurrency waiting (and more than 2, so a request caught between two engine
        steps is no backlog) while the gateway had no more than that concurrency in flight there. Such an
        engine runs less than the capacity model says its configuration runs (a smaller batch cap than
        modelled, or another client's load on it); goodput shows it only once the queue has grown."""
        concurrency = dict(rollout.options.pool_to_concurrency)
        waiting: list[tuple[str, int, int]] = []
        backlogged: list[str] = []
        for move in rollout.current:
            slot = self._slots.get(move.slot)
            if slot is None or slot.engine is None:  # no figures (not scraped yet, or no /metrics): goodput alone judges
                continue
            waiting.append((move.slot, slot.engine.num_waiting, slot.num_in_flight))
            planned = concurrency.get(move.to_pool)
            if planned is not None and slot.num_in_flight <= planned \
                    and slot.engine.num_waiting > max(2.0, self.settings.verify_engine_backlog * planned):
                backlogged.append(move.slot)
        return tuple(waiting), tuple(backlogged)

    def _back_off(self, now: float) -> float:
        """A step or canary failed: no plan for a doubling back-off, and no refine of the plan it came from."""
        self._num_failures += 1
        backoff: float = self.settings.backoff_s * 2 ** (self._num_failures - 1)
        self._backoff_until = now + backoff
        self._refine_at = None
        return backoff

    def _roll_back(self, now: float, rollout: _Rollout, reason: str, never_healthy: tuple[str, ...] | None = None,
                   start_timeout_s: float | None = None) -> list[Decision]:
        """Every move of the current step goes back to its old pool and configuration; later steps are dropped."""
        backoff = self._back_off(now)
        undo = tuple(m.reversed(rollout.slot_to_old_config[m.slot]) for m in rollout.current)
        rollout.steps = []
        rollout.rolling_back = True
        rollout.mover = self._mover(undo, now)
        rollout.step_done_at = None
        self._commands += rollout.mover.advance(now, self._slots)  # the drains
        return [Decision(now, RollbackEvidence(reason=reason, backoff_s=backoff, plan_failed=True, never_healthy=never_healthy,
                                               start_timeout_s=start_timeout_s), undo)]


# How many standard deviations of its count a verify window's goodput may read below the floor: a
# one-sided test that rolls back about 2% of the steps whose goodput really sits at the floor.
VERIFY_NOISE_SD = 2.0


def counting_noise_rps(floor_rps: float, window_s: float) -> float:
    """How far below ``floor_rps`` a goodput counted over ``window_s`` may read by chance alone:
    ``VERIFY_NOISE_SD`` standard deviations of a Poisson count of ``floor_rps * window_s`` requests.
    At a few requests a second one more or less moves a window's goodput by more than the margin: on
    the CPU fleet of tests/gateway/test_real_drift.py a 12 s window of 12 met long prompts read 1.0
    req/s against a floor of 1.02 (12.2 requests) and rolled the step back; with 2 standard deviations
    the floor gives way by 0.58 req/s there. At a GPU fleet's 25 req/s over 45 s it gives way by 1.5
    req/s (6% of the floor)."""
    if window_s <= 0 or floor_rps <= 0:
        return 0.0
    return VERIFY_NOISE_SD * math.sqrt(floor_rps * window_s) / window_s


def _rounded(pool_to_share: Mapping[str, float]) -> dict[str, float] | None:
    """The plan evidence's ``foreign_share``: None (no key) when no pool had foreign load."""
    return {pool: round(share, 3) for pool, share in sorted(pool_to_share.items())} or None


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

