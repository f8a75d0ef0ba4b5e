"""Tier objectives as the fleet's policies see them: SLO targets, goodput weight, priority.

The gateway's config owns the user-facing tier table; it hands the fleet these values (fleet does not
import gateway). The defaults are config.example.yaml's tiers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class TierSlo:
    ttft_p99_s: float
    tpot_p99_s: float
    weight: float  # value of one request that meets this SLO, relative to the others (planner objective)
    priority: int  # 0 is served first when capacity is short

    def met(self, ttft_s: float, tpot_s: float) -> bool:
        return ttft_s <= self.ttft_p99_s and tpot_s <= self.tpot_p99_s


DEFAULT_TIERS: Mapping[str, TierSlo] = {
    "interactive": TierSlo(1.0, 0.05, 4.0, 0),
    "standard": TierSlo(3.0, 0.10, 2.0, 1),
    "batch": TierSlo(60.0, 0.50, 1.0, 2),
}


class Objectives(Protocol):
    """A tier as a config declares it (gateway.config.TierObjectives is one)."""

    @property
    def ttft_p99_s(self) -> float: ...
    @property
    def tpot_p99_s(self) -> float: ...
    @property
    def priority(self) -> int: ...


def from_objectives(tiers: Mapping[str, Objectives]) -> dict[str, TierSlo]:
    """The fleet's view of configured tiers: a tier is worth twice one of the next lower priority."""
    lowest = max(t.priority for t in tiers.values())
    return {name: TierSlo(t.ttft_p99_s, t.tpot_p99_s, 2.0 ** (lowest - t.priority), t.priority) for name, t in tiers.items()}


def strictest(tier_to_share: Mapping[str, float], tiers: Mapping[str, TierSlo], min_share: float = 0.05) -> TierSlo:
    """The SLO a pool must plan for: the tightest TTFT and TPOT among tiers with a real share of its traffic."""
    present = [tiers[t] for t, share in tier_to_share.items() if share >= min_share and t in tiers] or [tiers["standard"]]
    best = min(present, key=lambda slo: slo.priority)
    return TierSlo(min(s.ttft_p99_s for s in present), min(s.tpot_p99_s for s in present), best.weight, best.priority)


def tier_weight(tier_to_share: Mapping[str, float], tiers: Mapping[str, TierSlo]) -> float:
    """Goodput value of one request of a shape: its tiers' weights averaged by share."""
    total = sum(tier_to_share.values())
    if total <= 0:
        return 1.0
    return sum(tiers[t].weight * share for t, share in tier_to_share.items() if t in tiers) / total
