"""Pure workload transforms: time scaling, rate scaling, windowing, and tenant/tier/domain assignment.

Each takes a ``Workload`` and returns a new one (specs are frozen). Assignment by fraction draws
from a seeded generator, so the same seed gives the same labels; assignment by rule takes the
first rule whose conditions hold.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from loadtest.spec import RequestSpec, Workload

ASSIGNABLE_FIELDS: tuple[str, ...] = ("tenant", "tier", "domain")


def speed_up(workload: Workload, speedup: float) -> Workload:
    """Divide every arrival time by ``speedup`` (2 = twice as fast, same requests)."""
    if not speedup > 0:
        raise ValueError(f"speedup must be > 0, got {speedup}")
    specs = tuple(replace(spec, arrival_s=spec.arrival_s / speedup) for spec in workload.specs)
    onsets = tuple(onset / speedup for onset in workload.drift_onsets_s)
    return replace(workload, specs=specs, duration_s=workload.duration_s / speedup, drift_onsets_s=onsets)


def scale_to_rate(workload: Workload, rate_rps: float) -> Workload:
    """Compress or stretch time so the mean rate is ``rate_rps``; bursts keep their shape."""
    if not rate_rps > 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate_rps}")
    if not workload.specs:
        return workload
    if workload.duration_s <= 0:
        raise ValueError(f"the {len(workload.specs)} requests of {workload.name} all arrive at one instant: they have no mean rate to scale to {rate_rps:g} req/s")
    return speed_up(workload, rate_rps / workload.target_rate_rps)


def window(workload: Workload, start_s: float = 0.0, duration_s: float | None = None) -> Workload:
    """Keep arrivals in [start_s, start_s + duration_s) and move them to start at 0."""
    if start_s < 0:
        raise ValueError(f"start must be >= 0 s, got {start_s}")
    if duration_s is not None and not duration_s > 0:
        raise ValueError(f"duration must be > 0 s, got {duration_s}")
    end_s = float("inf") if duration_s is None else start_s + duration_s
    specs = tuple(
        replace(spec, arrival_s=spec.arrival_s - start_s) for spec in workload.specs if start_s <= spec.arrival_s < end_s
    )
    onsets = tuple(onset - start_s for onset in workload.drift_onsets_s if start_s <= onset < end_s)
    new_duration_s = min(end_s, workload.duration_s) - start_s
    return replace(workload, specs=specs, duration_s=max(0.0, new_duration_s), drift_onsets_s=onsets)


def assign_fractions(workload: Workload, field: str, value_to_fraction: Mapping[str, float], seed: int) -> Workload:
    """Set ``field`` (tenant, tier or domain) of each request to a value drawn with the given fractions."""
    _check_field(field)
    values = list(value_to_fraction)
    weights = np.array([float(value_to_fraction[value]) for value in values])
    if not values or (weights < 0).any() or weights.sum() <= 0:
        raise ValueError(f"{field} fractions must be non-negative and not all zero: {dict(value_to_fraction)}")
    rng = np.random.default_rng(seed)
    picks = rng.choice(len(values), size=len(workload.specs), p=weights / weights.sum())
    specs = tuple(replace(spec, **{field: values[pick]}) for spec, pick in zip(workload.specs, picks))
    return replace(workload, specs=specs)


@dataclass(frozen=True, slots=True)
class AssignRule:
    """Set ``field`` to ``value`` for requests matching every condition that is set."""

    field: str
    value: str
    min_input_tokens: int | None = None
    max_input_tokens: int | None = None
    min_output_tokens: int | None = None
    max_output_tokens: int | None = None
    domains: frozenset[str] | None = None
    tenants: frozenset[str] | None = None

    def matches(self, spec: RequestSpec) -> bool:
        bounds = (
            (self.min_input_tokens, spec.input_tokens, 1),
            (self.max_input_tokens, spec.input_tokens, -1),
            (self.min_output_tokens, spec.output_tokens, 1),
            (self.max_output_tokens, spec.output_tokens, -1),
        )
        for bound, actual, sign in bounds:
            if bound is not None and sign * (actual - bound) < 0:
                return False
        if self.domains is not None and spec.domain not in self.domains:
            return False
        return self.tenants is None or spec.tenant in self.tenants


def assign_by_rules(workload: Workload, rules: Sequence[AssignRule]) -> Workload:
    """Apply rules in order; for each field, the first matching rule for that field wins."""
    for rule in rules:
        _check_field(rule.field)

    def apply(spec: RequestSpec) -> RequestSpec:
        changes: dict[str, str] = {}
        for rule in rules:
            if rule.field not in changes and rule.matches(spec):
                changes[rule.field] = rule.value
        return replace(spec, **changes) if changes else spec

    return replace(workload, specs=tuple(apply(spec) for spec in workload.specs))


def parse_fractions(text: str) -> dict[str, float]:
    """``"a=0.7,b=0.3"`` -> {"a": 0.7, "b": 0.3}; a bare name means all of it."""
    result: dict[str, float] = {}
    for part in (piece.strip() for piece in text.split(",")):
        if not part:
            continue
        name, sep, share = part.partition("=")
        if name.strip() in result:  # before, the last share silently won
            raise ValueError(f"bad fractions {text!r}: {name.strip()!r} is given twice")
        try:
            result[name.strip()] = float(share) if sep else 1.0
        except ValueError:
            raise ValueError(f"bad fraction {part!r}: expected NAME=NUMBER") from None
        if not name.strip() or result[name.strip()] < 0:
            raise ValueError(f"bad fraction {part!r}: expected NAME=NUMBER with NUMBER >= 0")
    if not result:
        raise ValueError(f"no fractions in {text!r}: expected NAME=NUMBER[,NAME=NUMBER...]")
    return result


def _check_field(field: str) -> None:
    if field not in ASSIGNABLE_FIELDS:
        raise ValueError(f"cannot assign {field!r}; assignable fields: {', '.join(ASSIGNABLE_FIELDS)}")
