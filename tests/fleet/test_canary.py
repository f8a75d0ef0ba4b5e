"""The canary judge (fleet.canary) and a trial's phases (fleet.canary_trial), on figures fed by hand."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from fleet.canary import ADOPT, ROLL_BACK, WAIT, CanarySettings, Noise, aa_noise, judge
from fleet.canary_trial import CanaryTrials
from fleet.commands import Activate, Command, Drain, Start, Stop
from fleet.compile_sources import VirtualTimeConfigSource
from fleet.controller import Controller, ControllerSettings
from fleet.decisions import Decision
from fleet.drift import DriftSettings
from fleet.evidence import CanaryEvidence, RollbackEvidence, StepEvidence, VerifyEvidence
from fleet.operator import MoveRefused
from fleet.options import pool_options
from fleet.replica_outcomes import ReplicaFigures, ReplicaOutcomes
from fleet.rollout import SlotState
from fleet.telemetry import Telemetry
from kernels.compiler import TrialStore
from tests.fleet.test_compiled_configs import GPU, MODEL, EnvelopeCompiledFaster, _feed
from tests.fleet.test_compiled_configs import SETTINGS as COMPILE
from tests.fleet.test_planner_rollout import FakeActuator, tick

SETTINGS = CanarySettings(window_s=10.0, min_requests=5, min_margin=0.05)
OLD, NEW = '{"max_running_requests":1}', '{"max_running_requests":4}'


def _figures(slot: str, s_per_token: float, num: int = 20, failed: int = 0, met: int | None = None, cv: float = 0.2) -> ReplicaFigures:
    return ReplicaFigures(slot, num, failed, num if met is None else met, 10 * (num - failed), s_per_token, cv, 0.1, 0.01)


def test_a_canary_faster_than_its_siblings_beyond_their_spread_is_adopted() -> None:
    siblings = (_figures("b", 0.020), _figures("c", 0.022))
    verdict = judge(_figures("a", 0.010), siblings, None, 1.0, SETTINGS)
    assert verdict.outcome == ADOPT and verdict.noise is not None and verdict.noise.source == "siblings"
    assert verdict.margin == pytest.approx(0.002 / 0.021) and verdict.gain == pytest.approx(1 - 0.010 / 0.021)


def test_a_gain_inside_the_noise_between_siblings_is_rolled_back() -> None:
    siblings = (_figures("b", 0.015), _figures("c", 0.025))  # 50% apart on one configuration
    verdict = judge(_figures("a", 0.016), siblings, None, 1.0, SETTINGS)
    assert verdict.outcome == ROLL_BACK and "not over the 50.0% margin" in verdict.reason


def test_one_sibling_uses_the_aa_noise_and_the_floor_margin() -> None:
    aa = Noise(0.01, "a/a", (_figures("a", 0.020), _figures("b", 0.0202)))
    small_gain = judge(_figures("a", 0.0196), (_figures("b", 0.020),), aa, 1.0, SETTINGS)
    assert small_gain.outcome == ROLL_BACK and small_gain.margin == 0.05  # the 2% gain is under min_margin
    worse = judge(_figures("a", 0.040), (_figures("b", 0.020),), aa, 1.0, SETTINGS)
    assert worse.outcome == ROLL_BACK and worse.gain == pytest.approx(-1.0)
    with pytest.raises(ValueError, match="A/A"):
        judge(_figures("a", 0.010), (_figures("b", 0.020),), None, 1.0, SETTINGS)


def test_the_aa_window_gives_the_slots_ratio_and_its_sampling_error_as_noise() -> None:
    whole = (_figures("a", 0.010, num=25, cv=0.5), _figures("b", 0.020, num=25, cv=0.5))
    noise = aa_noise(*whole)
    # relative standard error of the ratio: sqrt(2 x 0.25 / 25) = 0.141; twice (the trial's ratio), at 2 errors
    assert noise is not None and noise.ratio == pytest.approx(0.5) and noise.spread == pytest.approx(0.4)
    assert aa_noise(_figures("a", 0.010, num=100, cv=0.5), whole[1]).spread < noise.spread  # more requests, less noise
    one_request = ReplicaFigures("a", 1, 0, 1, 10, 0.01, None, 0.1, None)
    assert aa_noise(one_request, whole[1]) is None  # no spread yet: not measured
    # the canary's slot was already twice as fast beside this sibling: the same ratio in the trial is no gain
    verdict = judge(_figures("a", 0.010), (_figures("b", 0.020),), Noise(0.0, "a/a", whole, 0.5), 1.0, SETTINGS)
    assert verdict.outcome == ROLL_BACK and verdict.gain == pytest.approx(0.0)


def test_failures_or_missed_slos_roll_a_faster_canary_back() -> None:
    siblings = (_figures("b", 0.020), _figures("c", 0.020))
    assert judge(_figures("a", 0.010, failed=2), siblings, None, 1.0, SETTINGS).outcome == ROLL_BACK
    missed = judge(_figures("a", 0.010, met=10), siblings, None, 1.0, SETTINGS)
    assert missed.outcome == ROLL_BACK and "SLO" in missed.reason


def test_too_few_requests_waits_then_rolls_back() -> None:
    siblings = (_figures("b", 0.020), _figures("c", 0.020))
    assert judge(_figures("a", 0.010, num=3), siblings, None, 1.0, SETTINGS).outcome == WAIT
    assert judge(_figures("a", 0.010, num=3), siblings, None, 3.0, SETTINGS).outcome == ROLL_BACK


def test_replica_outcomes_sum_a_window_per_token() -> None:
    outcomes = ReplicaOutcomes()
    outcomes.record(1.0, "a", True, True, 0.5, 0.1, 6)  # 0.5 + 5 x 0.1 = 1.0 s for 6 tokens
    outcomes.record(2.0, "a", True, False, 2.0, None, 4)  # not streamed: its ttft is its whole time
    outcomes.record(3.0, "a", False, False, None, None, 0)
    outcomes.record(9.0, "a", True, True, 9.0, None, 1)  # outside the window
    found = outcomes.figures("a", 0.0, 5.0)
    assert (found.num_requests, found.num_failed, found.num_met_slo, found.num_tokens) == (3, 1, 1, 10)
    assert found.s_per_token == pytest.approx(0.3) and found.ttft_mean_s == pytest.approx(1.25)
    assert outcomes.figures("nobody", 0.0, 5.0).s_per_token is None


class _Fleet:
    """Applies a trial's commands to slots at once: a start is healthy by the next tick."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self.slots = {n: SlotState(n, "chat", "cpu", OLD) for n in names}
        self.applied: list[Command] = []

    def apply(self, commands: list[Command]) -> None:
        self.applied += commands
        for command in commands:
            if isinstance(command, Start):
                self.slots[command.slot] = SlotState(command.slot, command.pool, "cpu", command.config_json)

    def snapshot(self) -> list[SlotState]:
        return list(self.slots.values())


def _serve(outcomes: ReplicaOutcomes, start: float, end: float, slot_to_s_per_token: dict[str, float]) -> None:
    t = start
    while t < end:
        for slot, per_token in slot_to_s_per_token.items():
            outcomes.record(t, slot, True, True, per_token * 10, None, 10)
        t += 0.5


def _run(trials: CanaryTrials, fleet: _Fleet, outcomes: ReplicaOutcomes, start: float, speeds: dict[str, dict[str, float]]) -> list[object]:
    """Tick every second while the trial runs; each slot serves at its configuration's speed."""
    evidence: list[object] = []
    now = start
    while trials.busy and now < start + 200:
        _serve(outcomes, now - 1.0, now, {slot: speeds[s.config_json][slot] for slot, s in fleet.slots.items()})
        out = trials.tick(now, fleet.snapshot())
        fleet.apply(out.commands)
        evidence += [d.evidence for d in out.decisions]
        now += 1.0
    return evidence


@pytest.mark.parametrize("better", [True, False])
def test_a_trial_with_one_sibling_measures_aa_then_adopts_or_rolls_back(better: bool) -> None:
    outcomes, fleet = ReplicaOutcomes(), _Fleet(("chat-0", "chat-1"))
    speeds = {OLD: {"chat-0": 0.020, "chat-1": 0.021}, NEW: {"chat-0": 0.010 if better else 0.030, "chat-1": 0.010 if better else 0.030}}
    _serve(outcomes, 0.0, 10.0, {"chat-0": 0.5, "chat-1": 0.001})  # before the request: not the A/A window
    trials = CanaryTrials(outcomes, SETTINGS)
    first = trials.request(10.0, fleet.snapshot(), "chat", NEW, source="operator")
    assert first.commands == [] and first.decisions == []  # the A/A window runs first
    with pytest.raises(MoveRefused, match="one trial at a time"):
        trials.request(10.0, fleet.snapshot(), "chat", NEW)
    evidence = _run(trials, fleet, outcomes, 11.0, speeds)
    assert isinstance(evidence[0], StepEvidence) and fleet.applied[0] == Drain("chat-0")
    verdict = next(e for e in evidence if isinstance(e, CanaryEvidence))
    # constant speeds: no sampling noise; the gain is against the slots' A/A ratio
    assert verdict.noise_source == "a/a" and verdict.noise == 0.0 and verdict.margin == 0.05
    assert verdict.aa_ratio == pytest.approx(0.020 / 0.021, abs=1e-4) and verdict.gain == pytest.approx(0.5 if better else -0.5, abs=0.02)
    assert set(verdict.sibling_figures) == {"chat-1"} and verdict.canary_figures["num_requests"] >= 5
    if better:
        assert verdict.outcome == "adopt" and isinstance(evidence[-1], VerifyEvidence)
        assert {s.config_json for s in fleet.slots.values()} == {NEW}
        assert fleet.applied.index(Stop("chat-1")) > fleet.applied.index(Activate("chat-0"))  # the sibling follows once the canary serves
    else:
        assert verdict.outcome == "roll back" and verdict.gain is not None and verdict.gain < 0
        assert isinstance(evidence[-1], RollbackEvidence) and evidence[-1].outcome == "restored"
        assert {s.config_json for s in fleet.slots.values()} == {OLD}


def test_a_trial_is_refused_for_a_pool_of_one_or_the_same_configuration() -> None:
    trials = CanaryTrials(ReplicaOutcomes(), SETTINGS)
    with pytest.raises(MoveRefused, match="two or more"):
        trials.request(0.0, [SlotState("chat-0", "chat", "cpu", OLD)], "chat", NEW)
    with pytest.raises(MoveRefused, match="already runs"):
        trials.request(0.0, _Fleet(("chat-0", "chat-1")).snapshot(), "chat", OLD)
    with pytest.raises(MoveRefused) as unknown:
        trials.request(0.0, [], "nope", NEW)
    assert unknown.value.status == 404


@pytest.mark.parametrize("better", [True, False])
def test_the_controller_canaries_an_in_place_recompile_before_the_pool_follows(tmp_path: Path, better: bool) -> None:
    """The compile test's drift (tests/fleet/test_compiled_configs.py) with canaries on: the 4-replica pool's
    recompile restarts one replica, judged against the 3 others; adopted, they follow; rolled back, only it restarts."""
    tel, outcomes = Telemetry(), ReplicaOutcomes()
    _feed(tel, 0.0, 200.0, 4.0, 1000)
    reference = tel.window(200.0)
    settings = ControllerSettings(MODEL, {GPU: 4}, drift=DriftSettings(min_interval_s=0.0), max_step_fraction=1.0)
    pool = f"long-context@{GPU}"
    with TrialStore(tmp_path / "t.sqlite3") as store:
        source = VirtualTimeConfigSource(COMPILE, store, s_per_trial=1.0)
        at_once = source.at_once()
        start = pool_options(reference.shapes, (GPU,), EnvelopeCompiledFaster({"long-context": 2.0}, at_once), settings.tiers, at_once)
        trials = CanaryTrials(outcomes, CanarySettings(window_s=20.0, min_requests=5))
        controller = Controller(settings, tel, EnvelopeCompiledFaster({"long-context": 2.0}, source), reference, source, trials)
        controller.options = start
        old = start.configs_json()[pool]
        actuator = FakeActuator({}, restart_s=0.0)
        slots = {f"{GPU}/{k}": SlotState(f"{GPU}/{k}", pool, GPU, old) for k in range(4)}
        _feed(tel, 200.0, 600.0, 8.0, 8000)  # prompts 8x longer: a compile, then a recompile of the pool
        made: list[Decision] = []
        for now in range(205, 600, 5):
            # each replica serves at its configuration's speed: the compiled one twice as fast (or half as fast)
            for name, slot in slots.items():
                per_token = 0.02 if slot.config_json == old else (0.01 if better else 0.04)
                for k in range(3):
                    outcomes.record(now - 5 + k, name, True, True, per_token * 10, None, 10)
            made += tick(controller, actuator, float(now), list(slots.values()))
            slots = {name: replace(s, config_json=actuator.slot_to_pool.get(name, (pool, s.config_json))[1]) for name, s in slots.items()}
    verdict = next(d.evidence for d in made if isinstance(d.evidence, CanaryEvidence))
    assert verdict.source is None and verdict.noise_source == "siblings" and len(verdict.siblings) == 3
    starts = [(slot, at) for kind, slot, at in actuator.calls if kind == "start"]
    canary_at = next(d.at for d in made if isinstance(d.evidence, CanaryEvidence))
    assert [slot for slot, at in starts if at < canary_at] == [verdict.canary]  # one replica first
    if better:
        assert verdict.outcome == "adopt" and {s.config_json for s in slots.values()} == {made_config(made)}
    else:
        assert verdict.outcome == "roll back" and {s.config_json for s in slots.values()} == {old}
        assert {slot for slot, _ in starts} == {verdict.canary} and controller.backing_off(canary_at + 1)


def made_config(made: list[Decision]) -> str:
    """The configuration the recompile moved to."""
    return next(d.moves[0].config_json for d in made if d.kind == "recompile")
