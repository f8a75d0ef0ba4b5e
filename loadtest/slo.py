"""Tier objectives for goodput: a request counts when it met its tier's TTFT and TPOT objectives.

Defaults match ``config.example.yaml`` ``tiers:``. A ``--slo`` file may be a Polymorph config (its
``tiers:`` is read) or a file holding just that mapping; ``TIER=SECONDS`` flags override single values.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

from kernels.tiers import DEFAULT_TIERS, FALLBACK_TIER, TierSlo, read_tier_slo
from kernels.yamlsrc import FieldPath, load_yaml
from loadtest.record import RequestRecord


def meets_slo(record: RequestRecord, slo: TierSlo) -> bool:
    """Streamed: TTFT and TPOT within objectives. Not streamed (no TTFT seen): the whole response
    within the time those objectives allow, ttft + tpot * (output tokens - 1)."""
    if not record.ok or record.e2e_s is None:
        return False
    if record.ttft_s is None:
        return record.e2e_s <= slo.e2e_budget_s(record.output_tokens)
    return slo.met(record.ttft_s, record.tpot_s)


def load_slos(path: Path | str) -> dict[str, TierSlo]:
    """Defaults overridden by the file's ``tiers:`` (``ttft_p99_s``/``tpot_p99_s`` per tier)."""
    path = Path(path)
    doc = load_yaml(path)  # a ConfigError (a ValueError) names the file and line, as every error below
    data = doc.data
    within: FieldPath = ("tiers",) if isinstance(data, dict) and "tiers" in data else ()
    tiers = data.get("tiers", data) if isinstance(data, dict) else None
    if not isinstance(tiers, dict):
        raise doc.error(within, "expected a `tiers:` mapping of tier -> {ttft_p99_s, tpot_p99_s}")
    tier_to_slo = dict(DEFAULT_TIERS)
    for tier, values in tiers.items():  # read as the gateway reads its tiers: the same fields and bounds
        base = tier_to_slo.get(str(tier), DEFAULT_TIERS[FALLBACK_TIER])
        tier_to_slo[str(tier)] = read_tier_slo(doc, (*within, tier), values, base)
    return tier_to_slo


def override_slos(tier_to_slo: Mapping[str, TierSlo], field: str, assignments: list[str]) -> dict[str, TierSlo]:
    """Apply ``TIER=SECONDS`` overrides of ``field`` ("ttft_p99_s" or "tpot_p99_s")."""
    result = dict(tier_to_slo)
    for assignment in assignments:
        tier, sep, value = assignment.partition("=")
        if not sep or not tier:
            raise ValueError(f"bad SLO override {assignment!r}: expected TIER=SECONDS")
        base = result.get(tier, DEFAULT_TIERS[FALLBACK_TIER])
        result[tier] = replace(base, **{field: _seconds(value, f"SLO override {assignment!r}")})
    return result


def _seconds(value: object, where: str) -> float:
    try:
        seconds = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"{where}: expected seconds, got {value!r}") from None
    if not seconds > 0:
        raise ValueError(f"{where}: must be > 0 seconds, got {value!r}")
    return seconds
