"""Pure summaries of a run: goodput, throughput, error rates, latency percentiles, timelines.

``summarize`` turns the per-request records into the ``results.json`` document. Goodput counts the
requests that met their tier's objectives (``slo.meets_slo``) per second of run duration.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kernels.tiers import TierSlo, slo_for
from loadtest.record import RequestRecord
from loadtest.slo import meets_slo

MAX_LAG_P99_MS = 5.0  # the generator is "keeping up" below this scheduling error ...
MAX_RATE_SHORTFALL = 0.02  # ... and within this fraction of the target rate


@dataclass(frozen=True, slots=True)
class RunFacts:
    """What the runner knows besides the records."""

    workload: str
    target_url: str
    model: str
    mode: str  # "open-loop" or "closed-loop"
    stream: bool
    duration_s: float  # from the run start to the last response
    drift_onsets_s: tuple[float, ...] = ()
    gateway_events: tuple[dict[str, Any], ...] = ()


def percentiles(values: Sequence[float] | np.ndarray) -> dict[str, float | None]:
    array = np.asarray(values, dtype=float)
    if array.size == 0:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    p50, p90, p99 = np.quantile(array, (0.5, 0.9, 0.99))
    return {"p50": float(p50), "p90": float(p90), "p99": float(p99), "mean": float(array.mean())}


def span_rate(instants_s: Sequence[float]) -> float | None:
    """Requests per second between the first and last instant ((n - 1) intervals over the span)."""
    if len(instants_s) < 2:
        return None
    span_s = max(instants_s) - min(instants_s)
    return (len(instants_s) - 1) / span_s if span_s > 0 else None


def _group(
    records: Sequence[RequestRecord], duration_s: float, tier_to_slo: Mapping[str, TierSlo]
) -> dict[str, Any]:
    met = [record for record in records if meets_slo(record, slo_for(tier_to_slo, record.tier))]
    completed = [record for record in records if record.ok]
    return {
        "requests": len(records),
        "completed": len(completed),
        "errors": len(records) - len(completed),
        "error_rate": (len(records) - len(completed)) / len(records) if records else 0.0,
        "goodput_rps": len(met) / duration_s if duration_s > 0 else 0.0,
        "slo_attainment": len(met) / len(records) if records else 0.0,
        "throughput_rps": len(completed) / duration_s if duration_s > 0 else 0.0,
        "output_tokens_per_s": sum(r.output_tokens for r in completed) / duration_s if duration_s > 0 else 0.0,
        "ttft_s": percentiles([r.ttft_s for r in completed if r.ttft_s is not None]),
        "tpot_s": percentiles([r.tpot_s for r in completed if r.tpot_s is not None]),
        "e2e_s": percentiles([r.e2e_s for r in completed if r.e2e_s is not None]),
    }


def _by(
    records: Sequence[RequestRecord],
    key: Callable[[RequestRecord], str],
    duration_s: float,
    tier_to_slo: Mapping[str, TierSlo],
) -> dict[str, Any]:
    groups: dict[str, list[RequestRecord]] = {}
    for record in records:
        groups.setdefault(key(record), []).append(record)
    return {name: _group(group, duration_s, tier_to_slo) for name, group in sorted(groups.items())}


def timeline(
    records: Sequence[RequestRecord], tier_to_slo: Mapping[str, TierSlo], bin_s: float, horizon_s: float
) -> dict[str, Any]:
    """Per bin of scheduled time: requests, goodput, p99 TTFT, errors and the traffic mix by label."""
    num_bins = max(1, int(np.ceil(horizon_s / bin_s)))
    bins: list[list[RequestRecord]] = [[] for _ in range(num_bins)]
    for record in records:
        bins[min(num_bins - 1, max(0, int(record.scheduled_at_s // bin_s)))].append(record)
    labels = sorted({record.label for record in records})
    return {
        "bin_s": bin_s,
        "start_s": [index * bin_s for index in range(num_bins)],
        "requests": [len(group) for group in bins],
        "errors": [sum(not r.ok for r in group) for group in bins],
        "goodput_rps": [
            sum(meets_slo(r, slo_for(tier_to_slo, r.tier)) for r in group) / bin_s for group in bins
        ],
        "p99_ttft_s": [percentiles([r.ttft_s for r in group if r.ok and r.ttft_s is not None])["p99"] for group in bins],
        "label_counts": {label: [sum(r.label == label for r in group) for group in bins] for label in labels},
    }


def timeline_bin_s(horizon_s: float) -> float:
    """About 60 bins over the run, at least one second each, in round numbers."""
    for candidate_s in (1, 2, 5, 10, 15, 30, 60, 120, 300, 600):
        if horizon_s / candidate_s <= 60:
            return float(candidate_s)
    return 900.0


def generator_health(records: Sequence[RequestRecord], mode: str) -> dict[str, Any]:
    """Achieved versus target rate and scheduling error; says plainly when the generator fell behind."""
    lags_ms = [record.lag_s * 1000 for record in records]
    target = span_rate([r.scheduled_at_s for r in records]) if mode == "open-loop" else None
    achieved = span_rate([r.sent_at_s for r in records])
    lag = percentiles(lags_ms)
    kept_up = True
    if target is not None and achieved is not None and lag["p99"] is not None:
        kept_up = achieved >= target * (1 - MAX_RATE_SHORTFALL) and lag["p99"] <= MAX_LAG_P99_MS
    note = "" if kept_up else (
        f"the load generator could not keep up: achieved {achieved:.1f} of {target:.1f} requests/s, "
        f"scheduling error p99 {lag['p99']:.1f} ms (limits: {MAX_RATE_SHORTFALL:.0%} and {MAX_LAG_P99_MS:.0f} ms)"
    )
    return {
        "target_rate": target,
        "achieved_rate": achieved,
        "scheduling_error_ms": {**lag, "max": max(lags_ms) if lags_ms else None},
        "generator_kept_up": kept_up,
        "generator_note": note,
    }


def summarize(
    records: Sequence[RequestRecord], facts: RunFacts, tier_to_slo: Mapping[str, TierSlo]
) -> dict[str, Any]:
    """The results.json document."""
    overall = _group(records, facts.duration_s, tier_to_slo)
    completed = [r for r in records if r.ok]
    horizon_s = max([facts.duration_s, *(r.scheduled_at_s for r in records)], default=1.0)
    failures = [r for r in records if not r.ok]
    return {
        "workload": facts.workload,
        "target": facts.target_url,
        "model": facts.model,
        "mode": facts.mode,
        "stream": facts.stream,
        "duration_s": facts.duration_s,
        **overall,
        **generator_health(records, facts.mode),
        "itl_s": percentiles([gap for r in completed for gap in r.itl_s]),
        "slo": {tier: {"ttft_s": slo.ttft_p99_s, "tpot_s": slo.tpot_p99_s} for tier, slo in tier_to_slo.items()},
        "by_tier": _by(records, lambda r: r.tier, facts.duration_s, tier_to_slo),
        "by_tenant": _by(records, lambda r: r.tenant, facts.duration_s, tier_to_slo),
        "by_pool": _by([r for r in records if r.pool], lambda r: r.pool, facts.duration_s, tier_to_slo),
        "errors_by_status": {str(k): v for k, v in sorted(Counter(r.status for r in failures).items())},
        "errors_by_reason": dict(Counter(r.error.split(":")[0] for r in failures).most_common(10)),
        "timeline": timeline(records, tier_to_slo, timeline_bin_s(horizon_s), horizon_s),
        "drift_onsets_s": list(facts.drift_onsets_s),
        "gateway_events": list(facts.gateway_events),
    }
