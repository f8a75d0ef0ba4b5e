"""Telemetry windows and the drift detector: exact windows, hysteresis, and no drift on stationary traffic."""

from __future__ import annotations

import pytest

from classifiers.shape import default_shape_rules
from fleet.drift import SURGE_MIN_REQUESTS, DriftDetector, DriftSettings, js_divergence, score
from fleet.simulator.world import classify
from fleet.telemetry import Telemetry
from loadtest.scenario import build_workload, load_scenario


def test_window_counts_complete_buckets_only() -> None:
    tel = Telemetry(window_s=20.0, bucket_s=5.0)
    for k in range(40):  # 2 requests/s of one shape for 20 s
        tel.record_arrival(k * 0.5, "chat", "batch" if k % 2 else "interactive", 100)
        tel.record_outcome(k * 0.5, "chat", "p", k % 2 == 0, 50)
    mix = tel.window(20.0)
    assert mix.window_s == 15.0  # three complete buckets; the ring keeps one for the bucket being filled
    (chat,) = mix.shapes
    assert chat.rate_rps == 2.0 and chat.mean_prompt_tokens == 100 and chat.mean_output_tokens == 50
    assert chat.tier_shares() == {"batch": 0.5, "interactive": 0.5}
    assert mix.pools[0].attainment == 0.5 and mix.goodput_rps() == 1.0
    assert tel.window(100.0).shapes == ()  # everything aged out


def test_windows_split_the_sample_into_its_spans_oldest_first() -> None:
    tel = Telemetry(window_s=125.0, bucket_s=5.0)
    for second in range(120):  # chat at 1 request/s throughout, a 30 s burst of 4 documents/s at 60-90 s
        tel.record_arrival(second + 0.5, "chat", "interactive", 100)
        for k in range(4 if 60 <= second < 90 else 0):
            tel.record_arrival(second + 0.1 * k, "docs", "batch", 5000)
    spans = tel.windows(120.0, 120.0, 30.0)
    assert [m.window_s for m in spans] == [30.0] * 4 and [m.ended_at for m in spans] == [30.0, 60.0, 90.0, 120.0]
    assert [{s.name: s.rate_rps for s in m.shapes} for m in spans] == [{"chat": 1.0}, {"chat": 1.0}, {"chat": 1.0, "docs": 4.0}, {"chat": 1.0}]
    assert {s.name: s.rate_rps for s in tel.window(120.0).shapes} == {"chat": 1.0, "docs": 1.0}  # the mean hides the burst
    assert [m.window_s for m in tel.windows(120.0, 40.0, 30.0)] == [40.0]  # shorter than 1.5 spans: the sample
    cut = [m.window_s for m in tel.windows(120.0, 115.0, 30.0)]
    assert sum(cut) == 115.0 and sorted(cut) == [25.0, 30.0, 30.0, 30.0]  # the whole sample, in spans near 30 s


def test_divergence_bounds() -> None:
    assert js_divergence({"a": 1.0}, {"a": 1.0}) == 0.0
    assert abs(js_divergence({"a": 1.0}, {"b": 1.0}) - 1.0) < 1e-12


def _feed(tel: Telemetry, scenario: str, rate: float, duration_s: float) -> list:
    workload = build_workload(load_scenario(scenario), duration_s=duration_s, rate_rps=rate)
    rules = default_shape_rules()
    return [(s.arrival_s, classify(s, rules), s) for s in workload.specs]


def _run_detector(scenario: str, rate: float, duration_s: float) -> list[float]:
    tel, det = Telemetry(), DriftDetector(DriftSettings())
    events = _feed(tel, scenario, rate, duration_s)
    fired, reference, i = [], None, 0
    for tick in range(5, int(duration_s) + 1, 5):
        while i < len(events) and events[i][0] < tick:
            at, shape, spec = events[i]
            tel.record_arrival(at, shape, spec.tier, spec.input_tokens)
            tel.record_outcome(at, shape, "p", True, spec.output_tokens)
            i += 1
        if reference is None and tel.covered_s(tick) >= 120:
            reference = tel.window(tick)  # the plan made at the end of warm-up
            det.on_plan(tick)
        if reference is not None:
            _, verdict = det.observe(tick, tel.window(tick), reference, tel.covered_s(tick))
            if verdict is not None:
                fired.append(verdict.at)
                reference = tel.window(tick)
                det.on_plan(tick)
    return fired


def test_stationary_traffic_never_drifts_after_warm_up() -> None:
    assert _run_detector("stationary", 20.0, 1200.0) == []


def test_drift_step_is_detected_once_after_the_dwell() -> None:
    fired = _run_detector("drift-step", 20.0, 600.0)
    assert len(fired) >= 1 and 300 + DriftSettings().strong_dwell_s <= fired[0] <= 400  # a strong score: the short dwell


def test_a_weak_score_waits_the_dwell_and_a_strong_one_the_strong_dwell() -> None:
    """The total rate 1.5x the plan's (score ~1.5) fires after dwell_s; 10x (score ~8.8) after strong_dwell_s."""
    settings = DriftSettings(min_interval_s=0.0, warmup_s=0.0)
    planned = Telemetry()
    for k in range(600):
        planned.record_arrival(k * 0.1, "a", "interactive", 100)
    for factor, dwell_s in ((1.5, settings.dwell_s), (10.0, settings.strong_dwell_s)):
        live, det = Telemetry(), DriftDetector(settings)
        for k in range(int(600 * factor)):
            live.record_arrival(k * 0.1 / factor, "a", "interactive", 100)
        first = None
        for now in range(0, 60, 5):
            current, verdict = det.observe(float(now), live.window(60.0), planned.window(60.0), 60.0)
            if verdict is not None:
                first = now
                break
        assert (current.score >= settings.strong_score) == (factor == 10.0)
        assert first == dwell_s, (factor, first)
    with pytest.raises(ValueError, match="strong_dwell_s"):
        DriftSettings(strong_dwell_s=60.0)


def test_score_names_the_signal_that_moved() -> None:
    tel_a, tel_b = Telemetry(), Telemetry()
    for k in range(600):
        tel_a.record_arrival(k * 0.1, "chat", "standard", 500)
        tel_b.record_arrival(k * 0.05, "chat", "standard", 500)  # same mix at twice the rate
        tel_b.record_arrival(k * 0.05 + 0.01, "chat", "standard", 500)
    result = score(tel_b.window(60.0), tel_a.window(60.0), DriftSettings())
    assert result.reason == "rate change" and result.divergence == 0.0 and result.score > 1


def _surge_fires_at(settings: DriftSettings, base_rps: float, surge_rps: float, with_recent: bool) -> float | None:
    """A one-shape load at ``base_rps`` for 120 s (the plan's), then ``surge_rps`` from t = 120 s: when drift fires."""
    tel, det = Telemetry(), DriftDetector(settings)
    arrivals = [k / base_rps for k in range(int(120 * base_rps))] + [120.0 + k / surge_rps for k in range(int(60 * surge_rps))]
    reference, i = None, 0
    for now in range(5, 181, 5):
        while i < len(arrivals) and arrivals[i] < now:
            tel.record_arrival(arrivals[i], "a", "interactive", 100)
            i += 1
        if now == 120:
            reference = tel.window(120.0)  # the plan made before the surge
        if reference is None:
            continue
        recent = tel.window(float(now), settings.strong_dwell_s) if with_recent else None
        _, verdict = det.observe(float(now), tel.window(float(now)), reference, 120.0, recent)
        if verdict is not None:
            return verdict.at
    return None


def test_a_surge_fires_after_the_strong_dwell_not_once_the_windows_mean_moves() -> None:
    settings = DriftSettings(min_interval_s=0.0)
    # 10 -> 70 req/s: the last 10 s score ~7.4 at once; the 120 s mean reaches a strong score only after ~40 s
    fast, slow = (_surge_fires_at(settings, 10.0, 70.0, recent) for recent in (True, False))
    assert fast is not None and slow is not None
    assert fast <= 120 + settings.strong_dwell_s + 2 * 5.0 and slow >= fast + 20, (fast, slow)
    # a sparse load's few seconds are noise, not a surge: 0.5 -> 4 req/s holds fewer than SURGE_MIN_REQUESTS in 10 s
    assert _surge_fires_at(settings, 0.5, 4.0, True) == _surge_fires_at(settings, 0.5, 4.0, False)
    assert 4.0 * settings.strong_dwell_s < SURGE_MIN_REQUESTS
