"""A canary trial on a live pool: one replica restarts on a new configuration, serves its share of the
pool's traffic beside its unchanged siblings, and is judged against them (fleet.canary).

Phases, one trial at a time, through the same ``Mover`` as every other move:
  a/a        (one sibling only) the canary's slot and its sibling serve on the old configuration for
             ``window_s`` from the request (longer until each finished ``min_requests``): their ratio and
             the noise (fleet.canary.aa_noise)
  starting   drain the canary, restart it in its pool with the new configuration, health, activate
  serving    both sides serve for ``window_s`` (longer while a side is short of requests); then the verdict
  adopting   the siblings restart with the new configuration one at a time (the pool keeps serving)
  rolling back  the canary restarts with the old configuration
Every verdict is a ``canary`` decision with both sides' figures, the noise and the margin; the moves
are ``step``, ``verify`` and ``rollback`` decisions (``source`` as asked: ``operator`` or absent).

It decides and never acts: ``request`` and ``tick`` return a ``TickOutput`` for the edge to apply.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from fleet.canary import ADOPT, WAIT, CanarySettings, CanaryVerdict, Noise, aa_noise, enough, judge
from fleet.commands import Activate, Command, TickOutput
from fleet.decisions import Decision, Move
from fleet.evidence import CanaryEvidence, RollbackEvidence, StepEvidence, VerifyEvidence
from fleet.operator import MoveRefused
from fleet.replica_outcomes import ReplicaOutcomes
from fleet.rollout import Mover, SlotState


@dataclass(slots=True)
class _Trial:
    pool: str
    canary: str
    siblings: tuple[str, ...]
    old_config_json: str
    new_config_json: str
    source: str | None
    requested_at: float
    phase: str = "a/a"
    aa_noise: Noise | None = None
    mover: Mover | None = None
    serving_since: float | None = None
    pending: list[Move] = field(default_factory=list)  # siblings still to restart while adopting


class CanaryTrials:
    def __init__(self, outcomes: ReplicaOutcomes, settings: CanarySettings, drain_timeout_s: float = 300.0,
                 start_timeout_s: float = 900.0) -> None:
        self.outcomes = outcomes
        self.settings = settings
        self.drain_timeout_s = drain_timeout_s
        self.start_timeout_s = start_timeout_s
        self._trial: _Trial | None = None
        self.num_rolled_back = 0  # verdicts that sent a canary back (the controller backs off after one)

    @property
    def busy(self) -> bool:
        return self._trial is not None

    @property
    def pool(self) -> str | None:
        """The pool on trial."""
        return self._trial.pool if self._trial is not None else None

    def request(self, now: float, slots: list[SlotState], pool: str, config_json: str, source: str | None = None) -> TickOutput:
        """Trial ``config_json`` on one replica of ``pool`` (the first by name). Raises ``MoveRefused``."""
        if self._trial is not None:
            raise MoveRefused(409, f"a canary of pool {self._trial.pool!r} is running; one trial at a time")
        members = sorted((s for s in slots if s.pool == pool), key=lambda s: s.slot)
        if not members:
            raise MoveRefused(404, f"no replica launched by this gateway serves in pool {pool!r}")
        if len(members) < 2 or not all(s.alive for s in members):
            raise MoveRefused(409, f"a canary needs two or more running replicas in pool {pool!r} (it has {sum(s.alive for s in members)})")
        old = members[0].config_json
        if any(s.config_json != old for s in members):
            raise MoveRefused(409, f"the replicas of pool {pool!r} do not all run one configuration")
        if config_json == old:
            raise MoveRefused(409, f"pool {pool!r} already runs that configuration")
        trial = _Trial(pool, members[0].slot, tuple(s.slot for s in members[1:]), old, config_json, source, now)
        self._trial = trial
        if len(trial.siblings) >= 2:  # the siblings' own spread over the trial window is the noise
            return TickOutput(self._start_canary(now, trial), self._advance(now, trial, {s.slot: s for s in slots}))
        return self.tick(now, slots)

    def tick(self, now: float, slots: list[SlotState]) -> TickOutput:
        trial = self._trial
        if trial is None:
            return TickOutput([], [])
        by_name = {s.slot: s for s in slots}
        if trial.phase == "a/a":
            return self._measure_aa(now, trial, by_name)
        mover = trial.mover
        commands = self._advance(now, trial, by_name)
        decisions: list[Decision] = []
        if trial.phase == "serving":
            decisions = self._judge(now, trial, by_name)
        elif trial.mover is not None and trial.mover.done:
            decisions = self._after_moves(now, trial)
        if self._trial is trial and trial.mover is not mover:
            commands += self._advance(now, trial, by_name)  # a mover begun this tick: its drains go out now
        return TickOutput(decisions, commands)

    def _measure_aa(self, now: float, trial: _Trial, slots: Mapping[str, SlotState]) -> TickOutput:
        # measured from the request on, not back from it: a window reaching back could hold an earlier trial's configurations
        w, start = self.settings.window_s, trial.requested_at
        figures = (self.outcomes.figures(trial.canary, start, now), self.outcomes.figures(trial.siblings[0], start, now))
        noise = aa_noise(*figures)
        if now - start >= w and enough(figures, self.settings) and noise is not None:
            trial.aa_noise = noise
            return TickOutput(self._start_canary(now, trial), self._advance(now, trial, slots))
        if now - trial.requested_at < self.settings.max_windows * w:
            return TickOutput([], [])
        self._trial = None
        return TickOutput([self._decision(now, trial, CanaryVerdict(
            "abandoned", f"fewer than {self.settings.min_requests} requests on a replica over the A/A window: the noise between "
                         "replicas on one configuration could not be measured", figures[0], figures[1:], None, None, None))], [])

    def _start_canary(self, now: float, trial: _Trial) -> list[Decision]:
        move = Move(trial.canary, trial.pool, trial.pool, trial.new_config_json)
        trial.phase, trial.mover = "starting", self._mover((move,), now)
        return [Decision(now, StepEvidence(source=trial.source, reason=f"canary of pool {trial.pool!r}: one replica on the new configuration",
                                           from_config=trial.old_config_json, to_config=trial.new_config_json), (move,))]

    def _advance(self, now: float, trial: _Trial, slots: Mapping[str, SlotState]) -> list[Command]:
        if trial.mover is None or trial.mover.done:
            return []
        commands = trial.mover.advance(now, slots)
        if trial.phase == "starting" and any(isinstance(c, Activate) for c in commands):
            trial.phase, trial.serving_since = "serving", now
        return commands

    def _judge(self, now: float, trial: _Trial, slots: Mapping[str, SlotState]) -> list[Decision]:
        assert trial.serving_since is not None
        waited_s = now - trial.serving_since
        canary = slots.get(trial.canary)
        if canary is None or not canary.alive:
            figures = self.outcomes.figures(trial.canary, trial.serving_since, now)
            siblings = tuple(self.outcomes.figures(s, trial.serving_since, now) for s in trial.siblings)
            return self._roll_back(now, trial, CanaryVerdict("roll back", "the canary's replica is gone", figures, siblings,
                                                             trial.aa_noise, None, None))
        if waited_s < self.settings.window_s:
            return []
        figures = self.outcomes.figures(trial.canary, trial.serving_since, now)
        siblings = tuple(self.outcomes.figures(s, trial.serving_since, now) for s in trial.siblings)
        verdict = judge(figures, siblings, trial.aa_noise, waited_s / self.settings.window_s, self.settings)
        if verdict.outcome == WAIT:
            return []
        if verdict.outcome != ADOPT:
            return self._roll_back(now, trial, verdict)
        trial.phase = "adopting"
        trial.pending = [Move(s, trial.pool, trial.pool, trial.new_config_json) for s in trial.siblings]
        return [self._decision(now, trial, verdict), *self._next_sibling(now, trial)]

    def _next_sibling(self, now: float, trial: _Trial) -> list[Decision]:
        move = trial.pending.pop(0)
        trial.mover = self._mover((move,), now)
        return [Decision(now, StepEvidence(source=trial.source, reason=f"canary of pool {trial.pool!r} adopted: the siblings follow",
                                           from_config=trial.old_config_json, to_config=trial.new_config_json, num_steps_left=len(trial.pending)),
                         (move,))]

    def _roll_back(self, now: float, trial: _Trial, verdict: CanaryVerdict) -> list[Decision]:
        undo = Move(trial.canary, trial.pool, trial.pool, trial.old_config_json)
        trial.phase, trial.mover = "rolling back", self._mover((undo,), now)
        self.num_rolled_back += 1
        return [self._decision(now, trial, verdict),
                Decision(now, RollbackEvidence(source=trial.source, reason=verdict.reason), (undo,))]

    def _after_moves(self, now: float, trial: _Trial) -> list[Decision]:
        """The current mover finished: the canary's start, a sibling's restart, or the rollback."""
        mover = trial.mover
        assert mover is not None
        if trial.phase == "rolling back":
            self._trial = None
            if mover.failed:
                return [Decision(now, RollbackEvidence(source=trial.source, outcome="failed",
                                                       reason="the previous configuration never became healthy either"), mover.failed)]
            return [Decision(now, RollbackEvidence(source=trial.source, outcome="restored",
                                                   reason="the canary serves again with the pool's configuration"),
                             (Move(trial.canary, trial.pool, trial.pool, trial.old_config_json),))]
        if mover.failed:  # the canary (or a sibling while adopting) never became healthy: it goes back
            undo = tuple(m.reversed(trial.old_config_json) for m in mover.failed)
            trial.phase, trial.mover = "rolling back", self._mover(undo, now)
            self.num_rolled_back += 1
            return [Decision(now, RollbackEvidence(source=trial.source, reason="replica never became healthy", never_healthy=tuple(
                m.slot for m in mover.failed), start_timeout_s=self.start_timeout_s), undo)]
        if trial.phase == "adopting" and trial.pending:
            return self._next_sibling(now, trial)
        self._trial = None
        return [Decision(now, VerifyEvidence(source=trial.source, ok=True, healthy=True, warmed_up=True, config=trial.new_config_json),
                         tuple(Move(s, trial.pool, trial.pool, trial.new_config_json) for s in (trial.canary, *trial.siblings)))]

    def _decision(self, now: float, trial: _Trial, verdict: CanaryVerdict) -> Decision:
        record = verdict.to_json()
        return Decision(now, CanaryEvidence(
            source=trial.source, pool=trial.pool, canary=trial.canary, siblings=trial.siblings, outcome=verdict.outcome,
            reason=verdict.reason, old_config=trial.old_config_json, new_config=trial.new_config_json, window_s=round(
                now - trial.serving_since if trial.serving_since is not None else self.settings.window_s, 3),
            canary_figures=record["canary_figures"], sibling_figures=record["sibling_figures"], noise=record["noise"],
            noise_source=record["noise_source"], noise_figures=record["noise_figures"], aa_ratio=record["aa_ratio"], margin=record["margin"],
            gain=record["gain"]))

    def _mover(self, moves: tuple[Move, ...], now: float) -> Mover:
        return Mover(moves, now, self.drain_timeout_s, self.start_timeout_s)

