"""Which engine configuration each pool adopted by canary, read back from the decision log.

A canary that wins (fleet.canary_trial) restarts the pool's replicas on its configuration; the config
file still declares the old one. A gateway that restarts with the same decision log starts those pools
on what they had adopted, so an adoption survives a restart as the log explains it, instead of being
undone silently until the next trial.

An adoption counts once it completed: its ``canary`` decision (outcome ``adopt``) and then the
``verify`` that every replica of the pool serves the new configuration, with no ``rollback`` of the
pool between them (a sibling that never became healthy rolls the trial back). Adoptions chain from the
configuration the operator declares now: declared -> A, then A -> B, gives B; an adoption made on any
other configuration (the operator since changed the pool's engine settings, or the controller had
recompiled it) is not followed, because the operator's newer word wins. Pure: the caller reads the log.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from fleet.canary import ADOPT
from fleet.decisions import LoggedDecision
from fleet.evidence import CanaryEvidence, RollbackEvidence, VerifyEvidence


@dataclass(frozen=True, slots=True)
class Adoption:
    """A pool's configuration after the adoptions the log holds on top of its declared one."""

    pool: str
    config_json: str
    adopted_at_unix_s: float  # the last adoption's verification
    num_adoptions: int  # how many chained adoptions led here from the declared configuration


def adopted_configs(decisions: Iterable[LoggedDecision], declared: Mapping[str, str]) -> dict[str, Adoption]:
    """Per pool of ``declared`` (pool -> its configuration's JSON, as ``PoolSpec.config_json`` spells it),
    the configuration its completed adoptions lead to; pools with none are left out."""
    pending: dict[str, CanaryEvidence] = {}  # pool -> its adopted canary whose siblings are still following
    found: dict[str, Adoption] = {}
    for decision in decisions:
        evidence = decision.evidence
        if isinstance(evidence, CanaryEvidence) and evidence.outcome == ADOPT:
            pending[evidence.pool] = evidence
        elif isinstance(evidence, RollbackEvidence):
            for move in decision.moves:
                pending.pop(move.to_pool, None)
        elif isinstance(evidence, VerifyEvidence) and evidence.ok:
            for pool in {move.to_pool for move in decision.moves}:
                trial = pending.get(pool)
                if trial is None or evidence.config != trial.new_config:
                    continue
                del pending[pool]
                done = found.get(pool)
                if trial.old_config != (declared.get(pool) if done is None else done.config_json):
                    continue
                found[pool] = Adoption(pool, trial.new_config, decision.at_unix_s, 1 if done is None else done.num_adoptions + 1)
    return {pool: adoption for pool, adoption in found.items() if adoption.config_json != declared[pool]}
