"""The dashboard's time series: exact values on a hand-computed fixture, the ring, the label cap, the bound."""

from __future__ import annotations

import time

import pytest

from gateway.series import OTHER_LABEL, Series, bin_upper_s, latency_bin


def _fixture() -> Series:
    series = Series(step_s=10, span_s=60)
    # Bucket 100 (t = 1000..1010): two interactive chats on pool chat, one standard long prompt on pool long.
    series.record(1000.0, "short-chat", "interactive", "chat", ok=True, met_slo=True, ttft_s=0.1, tpot_s=0.02)
    series.record(1003.5, "short-chat", "interactive", "chat", ok=True, met_slo=False, ttft_s=2.0, tpot_s=0.05)
    series.record(1009.9, "long-context", "standard", "long", ok=True, met_slo=True, ttft_s=1.0, tpot_s=None)
    # Bucket 101: a failed batch request (no latencies) and, in bucket 102 (still filling at t = 1025), one more.
    series.record(1012.0, "batch", "batch", "chat", ok=False, met_slo=False, ttft_s=None, tpot_s=None)
    series.record(1021.0, "batch", "batch", "chat", ok=True, met_slo=True, ttft_s=0.5, tpot_s=0.01)
    return series


def test_snapshot_matches_the_hand_computed_fixture() -> None:
    snapshot = _fixture().snapshot(1025.0, window_s=30)
    assert snapshot == {
        "step_s": 10,
        "t": [990, 1000, 1010],  # complete buckets only: 1020..1030 is still filling
        "mix": {"batch": [0.0, 0.0, 0.1], "long-context": [0.0, 0.1, 0.0], "short-chat": [0.0, 0.2, 0.0]},
        "tiers": {
            "batch": {"requests_rps": [0.0, 0.0, 0.1], "goodput_rps": [0.0, 0.0, 0.0], "ttft_p99_s": [None, None, None], "tpot_p99_s": [None, None, None]},
            # Two samples: the p99 is the larger one, exact because the bin edge is capped by the maximum.
            "interactive": {"requests_rps": [0.0, 0.2, 0.0], "goodput_rps": [0.0, 0.1, 0.0], "ttft_p99_s": [None, 2.0, None], "tpot_p99_s": [None, 0.05, None]},
            "standard": {"requests_rps": [0.0, 0.1, 0.0], "goodput_rps": [0.0, 0.1, 0.0], "ttft_p99_s": [None, 1.0, None], "tpot_p99_s": [None, None, None]},
        },
        "pools": {
            "chat": {"requests_rps": [0.0, 0.2, 0.1], "goodput_rps": [0.0, 0.1, 0.0]},
            "long": {"requests_rps": [0.0, 0.1, 0.0], "goodput_rps": [0.0, 0.1, 0.0]},
        },
    }


def test_slo_attainment_per_pool_over_the_window() -> None:
    series = _fixture()
    assert series.slo_attainment(1025.0, window_s=30) == {"chat": round(1 / 3, 4), "long": 1.0}
    assert series.slo_attainment(1035.0, window_s=10) == {"chat": 1.0}  # only bucket 102


def _ttft_p99s(ttfts_s: list[float]) -> list[float | None]:
    series = Series(step_s=10, span_s=60)
    for ttft_s in ttfts_s:
        series.record(1000.0, "s", "t", "p", ok=True, met_slo=True, ttft_s=ttft_s, tpot_s=None)
    return series.snapshot(1010.0, 10)["tiers"]["t"]["ttft_p99_s"]


def test_p99_is_the_upper_edge_of_the_bin_of_the_99th_percentile_sample() -> None:
    # 2 of 200 above: the 198th sample, the p99, is 0.1. frexp(0.1) = (0.8, -3): sub-bin 4 of 8 in
    # [2**-4, 2**-3), whose upper edge is (0.5 + 5/16) / 8 = 0.1015625.
    assert _ttft_p99s([0.1] * 198 + [5.0] * 2) == [0.1015625]
    # 201 samples, rank 199 (ceil of 198.99): 3 lie above where 2 may, so the p99 bin is 5.0's, capped at 5.0.
    assert _ttft_p99s([0.1] * 198 + [5.0] * 3) == [5.0]


def test_latency_bins_span_at_most_an_eighth_of_their_value() -> None:
    assert latency_bin(1.0) == latency_bin(1.1) == latency_bin(1.1249) != latency_bin(1.125)
    assert bin_upper_s(latency_bin(1.0)) == 1.125
    assert latency_bin(0.0) == latency_bin(1e-9) == 0
    assert latency_bin(1e9) == latency_bin(4096.0) == latency_bin(2047.9)


def test_the_ring_forgets_buckets_older_than_the_span_and_drops_late_records() -> None:
    series = Series(step_s=10, span_s=30)  # 3 complete buckets + the one filling
    series.record(1000.0, "a", "t", "p", ok=True, met_slo=True, ttft_s=None, tpot_s=None)
    series.record(1040.0, "b", "t", "p", ok=True, met_slo=True, ttft_s=None, tpot_s=None)  # reuses 1000's slot
    series.record(1000.0, "a", "t", "p", ok=True, met_slo=True, ttft_s=None, tpot_s=None)  # older than the ring: dropped
    snapshot = series.snapshot(1050.0, window_s=3600)  # the window is clamped to the span
    assert snapshot["t"] == [1020, 1030, 1040]
    assert snapshot["mix"] == {"b": [0.0, 0.0, 0.1]}
    assert series.snapshot(1095.0, window_s=3600) == {"step_s": 10, "t": [1060, 1070, 1080], "mix": {}, "tiers": {}, "pools": {}}


def test_buckets_a_snapshot_showed_are_final() -> None:
    series = Series(step_s=10, span_s=60)
    series.record(1000.0, "s", "t", "p", ok=True, met_slo=True, ttft_s=0.2, tpot_s=None)
    first = series.snapshot(1010.0, 10)
    assert first["tiers"]["t"]["ttft_p99_s"] == [0.2]
    # The snapshot's clock completed bucket 100: a record stamped inside it (a clock that stepped back) is dropped.
    series.record(1009.0, "s", "t", "p", ok=True, met_slo=True, ttft_s=0.4, tpot_s=None)
    assert series.snapshot(1010.0, 10) is first  # reused until the next bucket completes
    series.record(1010.0, "s", "t", "p", ok=True, met_slo=True, ttft_s=0.3, tpot_s=None)
    assert series.snapshot(1020.0, 20)["tiers"]["t"]["ttft_p99_s"] == [0.2, 0.3]


def test_labels_past_the_cap_are_counted_under_other() -> None:
    series = Series(step_s=10, span_s=60, max_num_shapes=2, max_num_tiers=2, max_num_pools=2)
    for i in range(5):
        series.record(1000.0, f"shape{i}", f"tier{i}", f"pool{i}", ok=True, met_slo=True, ttft_s=0.1 * (i + 1), tpot_s=None)
    snapshot = series.snapshot(1010.0, 10)
    assert snapshot["mix"] == {OTHER_LABEL: [0.3], "shape0": [0.1], "shape1": [0.1]}
    assert set(snapshot["tiers"]) == {OTHER_LABEL, "tier0", "tier1"}
    assert snapshot["tiers"][OTHER_LABEL]["ttft_p99_s"] == [0.5]
    assert set(snapshot["pools"]) == {OTHER_LABEL, "pool0", "pool1"}


def test_memory_is_fixed_once_every_label_is_seen() -> None:
    series = Series(step_s=10, span_s=3600, max_num_shapes=4, max_num_tiers=3, max_num_pools=2)
    sizes = []
    for hour in range(6):  # six hours of one request a second with ever new labels
        for second in range(0, 3600, 1):
            at = 1_000_000.0 + hour * 3600 + second
            n = hour * 3600 + second
            series.record(at, f"shape{n % 7}", f"tier{n % 5}", f"pool{n % 9}", ok=True, met_slo=n % 3 > 0, ttft_s=0.05 + n % 10 / 10, tpot_s=0.02)
            if second % 600 == 0:
                series.snapshot(at, 3600)
        sizes.append(series.num_bytes())
    assert sizes == [sizes[0]] * 6
    assert sizes[0] < 4_000_000, sizes[0]  # (3 + 1 tier rings) x 361 slots x 373 counters x 4 bytes is most of it


def test_record_costs_microseconds() -> None:
    series = Series()
    shapes, tiers = ("short-chat", "long-context", "reasoning", "batch"), ("interactive", "standard", "batch")
    num_calls = 30_000
    started = time.perf_counter()
    for i in range(num_calls):
        series.record(1_000_000.0 + i * 0.01, shapes[i & 3], tiers[i % 3], "chat", True, i & 1 == 0, 0.2, 0.03)
    per_call_s = (time.perf_counter() - started) / num_calls
    assert per_call_s < 20e-6, per_call_s  # ~1.5 us on this machine; generous for a loaded CI box


def test_invalid_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="step_s"):
        Series(step_s=0)
    with pytest.raises(ValueError, match="span_s"):
        Series(step_s=60, span_s=30)
