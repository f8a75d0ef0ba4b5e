"""Tiers: the default objectives and the one rule for "a request met its tier's SLO".

Every package reads tiers from here: the gateway's config (which may override them), the fleet's
router, planner and simulator, the compiler's named shapes and the load generator's goodput. The
defaults are config.example.yaml's ``tiers:``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from kernels.yamlsrc import FieldPath, FieldReader, YamlDoc


@dataclass(frozen=True, slots=True)
class TierSlo:
    ttft_p99_s: float  # objective on time to first token
    tpot_p99_s: float  # objective on time per output token after the first
    priority: int = 1  # 0 is served first when capacity is short
    deadline_s: float = 300.0  # how long a request of the tier may wait for a replica before it is refused

    def met(self, ttft_s: float | None, tpot_s: float | None) -> bool:
        """Both latencies within the objectives; one not observed (None) does not count against it:
        a one-token answer has no TPOT, and a caller that saw no first token judges the whole response
        with ``e2e_budget_s``."""
        return (ttft_s is None or ttft_s <= self.ttft_p99_s) and (tpot_s is None or tpot_s <= self.tpot_p99_s)

    def sped_up(self, speed: float) -> TierSlo:
        """These objectives on the wall clock of a fleet (emulated) ``speed`` times faster than real time."""
        return replace(self, ttft_p99_s=self.ttft_p99_s / speed, tpot_p99_s=self.tpot_p99_s / speed)

    def e2e_budget_s(self, output_tokens: int) -> float:
        """The whole response's time these objectives allow: ttft + tpot x (output tokens - 1)."""
        return self.ttft_p99_s + self.tpot_p99_s * max(0, output_tokens - 1)


DEFAULT_TIERS: Mapping[str, TierSlo] = {
    "interactive": TierSlo(1.0, 0.05, priority=0, deadline_s=60.0),
    "standard": TierSlo(3.0, 0.10, priority=1, deadline_s=300.0),
    "batch": TierSlo(60.0, 0.50, priority=2, deadline_s=3600.0),
}
FALLBACK_TIER = "standard"  # an unknown tier is held to this one's objectives


def slo_for(tiers: Mapping[str, TierSlo], tier: str) -> TierSlo:
    """The tier's objectives; an unknown tier is held to the standard tier's."""
    return tiers.get(tier) or tiers.get(FALLBACK_TIER) or DEFAULT_TIERS[FALLBACK_TIER]


def read_tier_slo(doc: YamlDoc, path: FieldPath, data: object, base: TierSlo | None) -> TierSlo:
    """One tier's objectives at ``path`` of a YAML document (a gateway config's ``tiers:`` or a tenant's
    ``objectives:``, a load test's ``--slo`` file), over ``base``; None: a new tier, which must give both
    latencies (the load tester starts a new tier from the standard tier's instead). Errors name the
    file, the line and the field."""
    r = FieldReader(doc, path, data, {"ttft_p99_s", "tpot_p99_s", "deadline_s", "priority"})
    if base is None:
        for key in ("ttft_p99_s", "tpot_p99_s"):
            if key not in r.data:
                raise doc.error(path, f"missing {key}")
        base = TierSlo(0.0, 0.0, priority=1, deadline_s=3600.0)
    return TierSlo(
        ttft_p99_s=r.number("ttft_p99_s", base.ttft_p99_s, lo=0.001, hi=86400),
        tpot_p99_s=r.number("tpot_p99_s", base.tpot_p99_s, lo=0.0001, hi=3600),
        deadline_s=r.number("deadline_s", base.deadline_s, lo=0.01, hi=86400),
        priority=r.number("priority", base.priority, lo=0, hi=100, integer=True),
    )
