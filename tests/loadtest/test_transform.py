"""Time scaling, rate scaling, windowing and tenant/tier assignment."""

from __future__ import annotations

from collections import Counter

import pytest

from loadtest.spec import RequestSpec, make_workload
from loadtest.transform import (
    AssignRule,
    assign_by_rules,
    assign_fractions,
    parse_fractions,
    scale_to_rate,
    speed_up,
    window,
)


def _workload(num: int = 11, gap_s: float = 1.0):  # type: ignore[no-untyped-def]
    specs = [RequestSpec(i * gap_s, 100 * (i + 1), 10, domain="code" if i % 2 else "chat") for i in range(num)]
    return make_workload("t", specs, drift_onsets_s=(4.0,))


def test_speed_up_divides_times_and_onsets() -> None:
    faster = speed_up(_workload(), 4)
    assert [spec.arrival_s for spec in faster.specs][:3] == [0.0, 0.25, 0.5]
    assert faster.duration_s == 2.5 and faster.drift_onsets_s == (1.0,)
    with pytest.raises(ValueError, match="speedup must be > 0"):
        speed_up(_workload(), 0)


def test_scale_to_rate_sets_the_mean_rate() -> None:
    scaled = scale_to_rate(_workload(), 22.0)
    assert scaled.target_rate_rps == pytest.approx(22.0)
    assert scaled.num_requests == 11


def test_window_keeps_and_rebases_the_range() -> None:
    cut = window(_workload(), start_s=3, duration_s=4)
    assert [spec.arrival_s for spec in cut.specs] == [0.0, 1.0, 2.0, 3.0]
    assert [spec.input_tokens for spec in cut.specs] == [400, 500, 600, 700]
    assert cut.duration_s == 4 and cut.drift_onsets_s == (1.0,)
    assert window(_workload(), start_s=8).num_requests == 3


def test_assign_fractions_is_seeded_and_near_the_fractions() -> None:
    workload = _workload(num=4000, gap_s=0.01)
    first = assign_fractions(workload, "tenant", {"acme": 0.75, "globex": 0.25}, seed=5)
    again = assign_fractions(workload, "tenant", {"acme": 0.75, "globex": 0.25}, seed=5)
    assert first == again
    counts = Counter(spec.tenant for spec in first.specs)
    assert counts["acme"] / 4000 == pytest.approx(0.75, abs=0.02)
    with pytest.raises(ValueError, match="cannot assign"):
        assign_fractions(workload, "model", {"x": 1}, seed=0)


def test_rules_first_match_per_field_wins() -> None:
    rules = [
        AssignRule("tier", "batch", min_input_tokens=900),
        AssignRule("tier", "interactive", domains=frozenset({"chat"})),
        AssignRule("tenant", "coder", domains=frozenset({"code"})),
    ]
    assigned = assign_by_rules(_workload(), rules)
    tiers = [spec.tier for spec in assigned.specs]
    assert tiers == ["interactive", "standard", "interactive", "standard", "interactive",
                     "standard", "interactive", "standard", "batch", "batch", "batch"]
    assert [spec.tenant for spec in assigned.specs][:2] == ["default", "coder"]


def test_parse_fractions() -> None:
    assert parse_fractions("a=0.7, b=0.3") == {"a": 0.7, "b": 0.3}
    assert parse_fractions("batch") == {"batch": 1.0}
    with pytest.raises(ValueError, match="NAME=NUMBER"):
        parse_fractions("a=x")
    with pytest.raises(ValueError, match="'a' is given twice"):  # before, the last share won
        parse_fractions("a=0.7,a=0.3")
