"""Arrival schedules have the right rate and dispersion (seeded, so every number below is fixed)."""

from __future__ import annotations

import numpy as np
import pytest

from loadtest.arrivals import ArrivalProcess, arrival_times, diurnal_rate

DURATION_S = 2000.0


def _schedule(process: ArrivalProcess, seed: int = 11) -> np.ndarray:
    return arrival_times(process, DURATION_S, np.random.default_rng(seed))


def _iat_cv(times: np.ndarray) -> float:
    gaps = np.diff(times)
    return float(gaps.std() / gaps.mean())


def _index_of_dispersion(times: np.ndarray, window_s: float = 1.0) -> float:
    counts = np.histogram(times, bins=int(DURATION_S / window_s), range=(0, DURATION_S))[0]
    return float(counts.var() / counts.mean())


def test_poisson_has_its_rate_and_unit_dispersion() -> None:
    times = _schedule(ArrivalProcess("poisson", rate_rps=50))
    assert times.size / DURATION_S == pytest.approx(50, rel=0.01)  # sd of the count is 0.3%
    assert _iat_cv(times) == pytest.approx(1.0, abs=0.02)
    assert _index_of_dispersion(times) == pytest.approx(1.0, abs=0.1)
    assert np.all(np.diff(times) >= 0) and times.min() >= 0 and times.max() < DURATION_S


@pytest.mark.parametrize("cv", [0.5, 3.0, 8.0])
def test_gamma_has_its_rate_and_coefficient_of_variation(cv: float) -> None:
    times = _schedule(ArrivalProcess("gamma", rate_rps=50, cv=cv))
    assert times.size / DURATION_S == pytest.approx(50, rel=0.06 * cv)
    assert _iat_cv(times) == pytest.approx(cv, rel=0.1)


def test_mmpp_mean_rate_and_overdispersion() -> None:
    process = ArrivalProcess("mmpp", rate_rps=10, burst_rate_rps=100, mean_calm_s=20, mean_burst_s=5)
    assert process.mean_rate_rps == pytest.approx(28.0)
    times = _schedule(process)
    assert times.size / DURATION_S == pytest.approx(28.0, rel=0.15)
    assert _index_of_dispersion(times) > 20  # bursts: far above Poisson's 1


def test_diurnal_follows_its_sinusoid() -> None:
    process = ArrivalProcess("diurnal", rate_rps=40, period_s=DURATION_S, peak_to_trough=3, peak_at_s=500)
    assert diurnal_rate(process, 500) == pytest.approx(60.0)
    assert diurnal_rate(process, 1500) == pytest.approx(20.0)
    times = _schedule(process)
    assert times.size / DURATION_S == pytest.approx(40, rel=0.02)
    near_peak = np.count_nonzero((times > 400) & (times < 600)) / 200
    near_trough = np.count_nonzero((times > 1400) & (times < 1600)) / 200
    assert near_peak == pytest.approx(59, rel=0.1) and near_trough == pytest.approx(21, rel=0.15)


def test_same_seed_same_schedule_and_different_seed_differs() -> None:
    process = ArrivalProcess("gamma", rate_rps=5, cv=2)
    assert np.array_equal(_schedule(process, 3), _schedule(process, 3))
    assert not np.array_equal(_schedule(process, 3), _schedule(process, 4))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"process": "uniform", "rate_rps": 1}, "unknown arrival process"),
        ({"process": "poisson", "rate_rps": 0}, "rate_rps must be > 0"),
        ({"process": "gamma", "rate_rps": 1, "cv": 0}, "cv must be > 0"),
        ({"process": "mmpp", "rate_rps": 1}, "mmpp"),
        ({"process": "diurnal", "rate_rps": 1, "peak_to_trough": 0.5}, "diurnal"),
    ],
)
def test_bad_parameters_are_rejected(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ArrivalProcess(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("process", [ArrivalProcess("poisson", 1e12), ArrivalProcess("mmpp", 1.0, burst_rate_rps=1e12),
                                     ArrivalProcess("diurnal", 1e12)])
def test_a_schedule_too_large_to_hold_is_a_clear_error(process: ArrivalProcess) -> None:
    with pytest.raises(ValueError, match="a schedule holds at most 10,000,000"):  # before: numpy asked for terabytes
        arrival_times(process, 10.0, np.random.default_rng(0))
