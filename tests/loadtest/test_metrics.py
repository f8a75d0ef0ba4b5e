"""Goodput accounting against hand-computed values on a small fixture of records."""

from __future__ import annotations

import pytest

from kernels.tiers import DEFAULT_TIERS, TierSlo
from loadtest.metrics import RunFacts, generator_health, span_rate, summarize, timeline_bin_s
from loadtest.record import RequestRecord
from loadtest.slo import meets_slo


def _record(index: int, tier: str, ttft_s: float | None, tpot_s: float | None, *, tenant: str = "a",
            status: int = 200, error: str = "", e2e_s: float | None = 1.0, output_tokens: int = 11,
            scheduled_at_s: float = 0.0, lag_s: float = 0.0) -> RequestRecord:
    return RequestRecord(
        index=index, scheduled_at_s=scheduled_at_s, sent_at_s=scheduled_at_s + lag_s, ttft_s=ttft_s, itl_s=(),
        tpot_s=tpot_s, e2e_s=e2e_s if status == 200 and not error else None, input_tokens=100,
        output_tokens=output_tokens, target_input_tokens=100, target_output_tokens=output_tokens, status=status,
        error=error, tenant=tenant, tier=tier, domain="chat", label="x", stream=ttft_s is not None,
    )


# Objectives: interactive 1 s / 50 ms, standard 3 s / 100 ms, batch 60 s / 500 ms.
FIXTURE = (
    _record(0, "interactive", 0.5, 0.040, scheduled_at_s=0.5),   # met
    _record(1, "interactive", 1.2, 0.040, scheduled_at_s=1.5),   # TTFT missed
    _record(2, "interactive", 0.9, 0.060, scheduled_at_s=2.5),   # TPOT missed
    _record(3, "standard", 2.9, 0.099, tenant="b", scheduled_at_s=3.5),  # met
    _record(4, "standard", None, None, tenant="b", e2e_s=3.9, scheduled_at_s=4.5),  # non-stream: 3.9 <= 3 + 0.1*10: met
    _record(5, "standard", None, None, tenant="b", e2e_s=4.1, scheduled_at_s=5.5),  # non-stream: 4.1 > 4.0: missed
    _record(6, "batch", 30.0, 0.4, scheduled_at_s=6.5),          # met
    _record(7, "batch", None, None, status=503, error="http 503: busy", scheduled_at_s=7.5),  # error
    _record(8, "interactive", None, None, status=0, error="ClientConnectorError: refused", scheduled_at_s=8.5),
    _record(9, "interactive", 0.2, None, output_tokens=1, scheduled_at_s=9.5),  # one token, no TPOT: met
)


def test_meets_slo_cases() -> None:
    met = [meets_slo(record, DEFAULT_TIERS[record.tier]) for record in FIXTURE]
    assert met == [True, False, False, True, True, False, True, False, False, True]


def test_goodput_overall_per_tier_and_per_tenant_match_hand_counts() -> None:
    facts = RunFacts("fixture", "http://x", "m", "open-loop", True, duration_s=10.0)
    summary = summarize(FIXTURE, facts, DEFAULT_TIERS)
    assert summary["requests"] == 10 and summary["completed"] == 8 and summary["errors"] == 2
    assert summary["goodput_rps"] == pytest.approx(0.5)  # 5 met / 10 s
    assert summary["slo_attainment"] == pytest.approx(0.5)
    assert summary["throughput_rps"] == pytest.approx(0.8)
    assert summary["error_rate"] == pytest.approx(0.2)
    tiers = summary["by_tier"]
    assert (tiers["interactive"]["requests"], tiers["interactive"]["goodput_rps"]) == (5, pytest.approx(0.2))
    assert tiers["interactive"]["slo_attainment"] == pytest.approx(2 / 5)
    assert tiers["standard"]["goodput_rps"] == pytest.approx(0.2)
    assert tiers["batch"]["slo_attainment"] == pytest.approx(0.5)
    assert summary["by_tenant"]["a"]["goodput_rps"] == pytest.approx(0.3)
    assert summary["by_tenant"]["b"]["slo_attainment"] == pytest.approx(2 / 3)
    assert summary["errors_by_status"] == {"0": 1, "503": 1}
    ttfts = sorted(r.ttft_s for r in FIXTURE if r.ok and r.ttft_s is not None)
    assert summary["ttft_s"]["p50"] == pytest.approx((ttfts[2] + ttfts[3]) / 2)
    assert set(summary["ttft_s"]) >= {"p50", "p90", "p99"} and set(summary["tpot_s"]) >= {"p50", "p90", "p99"}


def test_goodput_over_time_bins_by_scheduled_arrival() -> None:
    facts = RunFacts("fixture", "http://x", "m", "open-loop", True, duration_s=10.0)
    line = summarize(FIXTURE, facts, DEFAULT_TIERS)["timeline"]
    assert line["bin_s"] == 1.0
    assert line["requests"] == [1] * 10
    assert line["goodput_rps"] == [1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0]
    assert line["errors"] == [0, 0, 0, 0, 0, 0, 0, 1, 1, 0]


def test_custom_objectives_change_the_count() -> None:
    lenient = {**DEFAULT_TIERS, "interactive": TierSlo(ttft_p99_s=2.0, tpot_p99_s=0.1)}
    facts = RunFacts("fixture", "http://x", "m", "open-loop", True, duration_s=10.0)
    assert summarize(FIXTURE, facts, lenient)["goodput_rps"] == pytest.approx(0.7)


def test_generator_health_flags_lag_and_shortfall() -> None:
    on_time = [_record(i, "standard", 0.1, 0.01, scheduled_at_s=i * 0.01, lag_s=0.001) for i in range(101)]
    health = generator_health(on_time, "open-loop")
    assert health["target_rate"] == pytest.approx(100.0) and health["achieved_rate"] == pytest.approx(100.0)
    assert health["generator_kept_up"] and health["generator_note"] == ""
    late = [_record(i, "standard", 0.1, 0.01, scheduled_at_s=i * 0.01, lag_s=i * 0.0005) for i in range(101)]
    behind = generator_health(late, "open-loop")
    assert behind["achieved_rate"] == pytest.approx(100 / 1.05)
    assert not behind["generator_kept_up"] and "could not keep up" in behind["generator_note"]


def test_span_rate_and_bins() -> None:
    assert span_rate([0.0, 1.0, 2.0]) == 1.0 and span_rate([1.0]) is None
    assert timeline_bin_s(30) == 1.0 and timeline_bin_s(600) == 10.0 and timeline_bin_s(3600) == 60.0
