"""Tiers as the fleet's planner sees them: the SLO a pool plans for and the goodput value of a request.

The objectives themselves (kernels.tiers.TierSlo, DEFAULT_TIERS) live in kernels; the gateway's config
may override them and hands the result to the fleet (fleet does not import gateway).
"""

from __future__ import annotations

from collections.abc import Mapping

from kernels.tiers import TierSlo


def weight(slo: TierSlo, tiers: Mapping[str, TierSlo]) -> float:
    """Value of one request that meets ``slo``, relative to the others (the planner's objective):
    a tier is worth twice one of the next lower priority."""
    lowest = max(t.priority for t in tiers.values())
    return 2.0 ** (lowest - slo.priority)


def strictest(tier_to_share: Mapping[str, float], tiers: Mapping[str, TierSlo], min_share: float = 0.05) -> TierSlo:
    """The SLO a pool must plan for: the tightest TTFT and TPOT among tiers with a real share of its traffic,
    at the priority (and deadline) of the most urgent of them."""
    present = [tiers[t] for t, share in tier_to_share.items() if share >= min_share and t in tiers] or [tiers["standard"]]
    best = min(present, key=lambda slo: slo.priority)
    return TierSlo(min(s.ttft_p99_s for s in present), min(s.tpot_p99_s for s in present), best.priority, best.deadline_s)


def tier_weight(tier_to_share: Mapping[str, float], tiers: Mapping[str, TierSlo]) -> float:
    """Goodput value of one request of a shape: its tiers' weights averaged by share."""
    total = sum(tier_to_share.values())
    if total <= 0:
        return 1.0
    return sum(weight(tiers[t], tiers) * share for t, share in tier_to_share.items() if t in tiers) / total
