"""What a restarted gateway reads back from the decision log as each pool's adopted configuration
(fleet.adoptions): the trials here run through the real canary state machine (fleet.canary_trial) and
their decisions go through the log's JSON lines, as a gateway writes and reads them."""

from __future__ import annotations

from fleet.adoptions import Adoption, adopted_configs
from fleet.canary_trial import CanaryTrials
from fleet.decisions import Decision, LoggedDecision, Move, read_decision
from fleet.evidence import CanaryEvidence, RollbackEvidence, StepEvidence
from fleet.replica_outcomes import ReplicaOutcomes
from tests.fleet.test_canary import NEW, OLD, SETTINGS, _Fleet, _serve

NEWER = '{"max_running_requests":8}'
OFFSET_S = 1_800_000_000.0  # the fleet clock's zero in Unix seconds


def _trial(trials: CanaryTrials, fleet: _Fleet, outcomes: ReplicaOutcomes, start: float, to_config: str,
           slot_to_s_per_token: dict[str, float]) -> tuple[list[Decision], float]:
    """One canary of pool chat to ``to_config``, ticked every second until it ends, each configuration serving
    at its speed (per slot, by configuration); its decisions and the time it ended."""
    trials.request(start, fleet.snapshot(), "chat", to_config)
    decisions: list[Decision] = []
    now = start + 1.0
    while trials.busy and now < start + 200:
        _serve(outcomes, now - 1.0, now, {slot: slot_to_s_per_token[s.config_json] for slot, s in fleet.slots.items()})
        out = trials.tick(now, fleet.snapshot())
        fleet.apply(out.commands)
        decisions += out.decisions
        now += 1.0
    assert not trials.busy
    return decisions, now


def _logged(decisions: list[Decision]) -> list[LoggedDecision]:
    found = [read_decision(d.to_json(OFFSET_S)) for d in decisions]
    assert None not in found
    return [d for d in found if d is not None]


def _canary(decisions: list[Decision]) -> CanaryEvidence:
    return next(d.evidence for d in decisions if isinstance(d.evidence, CanaryEvidence))


def test_a_completed_adoption_is_the_pools_configuration_and_adoptions_chain_from_the_declared_one() -> None:
    outcomes, fleet = ReplicaOutcomes(), _Fleet(("chat-0", "chat-1", "chat-2"))
    trials = CanaryTrials(outcomes, SETTINGS)
    speeds = {OLD: 0.02, NEW: 0.01, NEWER: 0.005}
    first, now = _trial(trials, fleet, outcomes, 0.0, NEW, speeds)
    second, _ = _trial(trials, fleet, outcomes, now, NEWER, speeds)
    assert _canary(first).outcome == _canary(second).outcome == "adopt"
    once = adopted_configs(_logged(first), {"chat": OLD})
    assert once == {"chat": Adoption("chat", NEW, first[-1].at + OFFSET_S, 1)}
    twice = adopted_configs(_logged(first + second), {"chat": OLD, "other": OLD})
    assert twice == {"chat": Adoption("chat", NEWER, second[-1].at + OFFSET_S, 2)}
    # the operator declares another configuration since: the log's adoptions were made on an older one
    assert adopted_configs(_logged(first + second), {"chat": '{"max_running_requests":2}'}) == {}
    # declared as the first adoption's result: the second one still follows from it
    assert adopted_configs(_logged(first + second), {"chat": NEW}) == {"chat": Adoption("chat", NEWER, second[-1].at + OFFSET_S, 1)}


def test_a_rolled_back_canary_and_an_adoption_whose_siblings_had_not_all_followed_restore_nothing() -> None:
    outcomes, fleet = ReplicaOutcomes(), _Fleet(("chat-0", "chat-1", "chat-2"))
    trials = CanaryTrials(outcomes, SETTINGS)
    worse, now = _trial(trials, fleet, outcomes, 0.0, NEW, {OLD: 0.01, NEW: 0.02})
    assert _canary(worse).outcome == "roll back"
    assert adopted_configs(_logged(worse), {"chat": OLD}) == {}
    better, _ = _trial(trials, fleet, outcomes, now, NEW, {OLD: 0.02, NEW: 0.01})
    assert _canary(better).outcome == "adopt"
    # the gateway stopped while the last sibling restarted: its verify was never written
    assert adopted_configs(_logged(worse + better[:-1]), {"chat": OLD}) == {}
    assert adopted_configs(_logged(worse + better), {"chat": OLD})["chat"].config_json == NEW


def test_an_adoption_rolled_back_because_a_sibling_never_became_healthy_restores_nothing() -> None:
    outcomes, fleet = ReplicaOutcomes(), _Fleet(("chat-0", "chat-1", "chat-2"))
    trials = CanaryTrials(outcomes, SETTINGS)
    adopted, _ = _trial(trials, fleet, outcomes, 0.0, NEW, {OLD: 0.02, NEW: 0.01})
    upto = next(i for i, d in enumerate(adopted) if isinstance(d.evidence, CanaryEvidence)) + 2  # the verdict and the first sibling's step
    assert isinstance(adopted[upto - 1].evidence, StepEvidence)
    failed = Decision(adopted[upto - 1].at + 30, RollbackEvidence(reason="replica never became healthy", never_healthy=("chat-1",)),
                      (Move("chat-1", "chat", "chat", OLD),))
    # a later verify of the same configuration (another trial's, say) does not revive the rolled-back adoption
    assert adopted_configs(_logged([*adopted[:upto], failed, adopted[-1]]), {"chat": OLD}) == {}
