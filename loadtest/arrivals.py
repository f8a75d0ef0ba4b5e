"""Parametric arrival processes: Poisson, Gamma (bursty renewal), two-state MMPP, and diurnal.

Each returns the sorted arrival times in [0, duration_s) as a numpy array, drawn from the injected
generator, so a seed fixes the schedule. The Gamma process takes the inter-arrival coefficient of
variation (CV) the traces report: CV 1 is Poisson, the Azure 2023 code trace has CV 13.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

# each process and the parameters it reads (a scenario giving another, `cv` to poisson, is refused)
PROCESS_PARAMS: dict[str, tuple[str, ...]] = {
    "poisson": ("rate_rps",),
    "gamma": ("rate_rps", "cv"),
    "mmpp": ("rate_rps", "burst_rate_rps", "mean_calm_s", "mean_burst_s"),
    "diurnal": ("rate_rps", "period_s", "peak_to_trough", "peak_at_s"),
}
PROCESSES: tuple[str, ...] = tuple(PROCESS_PARAMS)

# The most arrivals one schedule may hold: each becomes a request object (about 200 bytes, so 2 GB here)
# and the draw itself a float array. Before, `--rate 1e9` asked numpy for 41 GiB and ended in a traceback.
MAX_ARRIVALS = 10_000_000


def check_arrivals(rate_rps: float, duration_s: float) -> None:
    """ValueError when ``rate_rps`` for ``duration_s`` would schedule more than ``MAX_ARRIVALS`` requests."""
    expected = rate_rps * duration_s
    if expected > MAX_ARRIVALS:
        raise ValueError(f"{rate_rps:g} requests/s for {duration_s:g} s is {expected:.3g} requests; a schedule holds at most "
                         f"{MAX_ARRIVALS:,} (lower the rate or the duration)")


@dataclass(frozen=True, slots=True)
class ArrivalProcess:
    """An arrival process by name and parameters (see ``arrival_times``)."""

    process: str
    rate_rps: float
    cv: float = 1.0  # gamma: inter-arrival coefficient of variation
    burst_rate_rps: float = 0.0  # mmpp: rate in the burst state (rate_rps is the calm state's)
    mean_calm_s: float = 60.0  # mmpp: mean dwell time in the calm state
    mean_burst_s: float = 10.0  # mmpp: mean dwell time in the burst state
    period_s: float = 86_400.0  # diurnal: period of the daily cycle
    peak_to_trough: float = 3.0  # diurnal: ratio of the peak rate to the trough rate
    peak_at_s: float = 0.0  # diurnal: time of the peak within the period

    def __post_init__(self) -> None:
        if self.process not in PROCESSES:
            raise ValueError(f"unknown arrival process {self.process!r}; choose one of {', '.join(PROCESSES)}")
        if not self.rate_rps > 0:
            raise ValueError(f"{self.process}: rate_rps must be > 0, got {self.rate_rps}")
        if self.process == "gamma" and not self.cv > 0:
            raise ValueError(f"gamma: cv must be > 0, got {self.cv}")
        if self.process == "mmpp" and (self.burst_rate_rps <= 0 or self.mean_calm_s <= 0 or self.mean_burst_s <= 0):
            raise ValueError("mmpp: burst_rate_rps, mean_calm_s and mean_burst_s must be > 0")
        if self.process == "diurnal" and (self.period_s <= 0 or self.peak_to_trough < 1):
            raise ValueError("diurnal: period_s must be > 0 and peak_to_trough >= 1")

    @property
    def mean_rate_rps(self) -> float:
        """The long-run mean rate."""
        if self.process == "mmpp":
            calm_share = self.mean_calm_s / (self.mean_calm_s + self.mean_burst_s)
            return calm_share * self.rate_rps + (1 - calm_share) * self.burst_rate_rps
        return self.rate_rps


def arrival_times(process: ArrivalProcess, duration_s: float, rng: np.random.Generator) -> np.ndarray:
    """Sorted arrival instants in [0, duration_s)."""
    if duration_s <= 0:
        return np.empty(0)
    check_arrivals(process.mean_rate_rps, duration_s)
    if process.process == "poisson":
        return _renewal(rng.exponential, (1.0 / process.rate_rps,), process.rate_rps, duration_s)
    if process.process == "gamma":
        shape = 1.0 / process.cv**2
        return _renewal(rng.gamma, (shape, 1.0 / (process.rate_rps * shape)), process.rate_rps, duration_s)
    if process.process == "mmpp":
        return _mmpp(process, duration_s, rng)
    return _diurnal(process, duration_s, rng)


def _renewal(
    draw: Callable[..., np.ndarray], params: tuple[float, ...], rate_rps: float, duration_s: float
) -> np.ndarray:
    """Cumulative sums of i.i.d. gaps, drawn in blocks until the horizon is passed."""
    chunks: list[np.ndarray] = []
    reached_s = 0.0
    block = max(16, int(rate_rps * duration_s * 1.1) + 16)
    while reached_s < duration_s:
        times = reached_s + np.cumsum(draw(*params, size=block))
        chunks.append(times)
        reached_s = float(times[-1])
    times = np.concatenate(chunks)
    return times[times < duration_s]


def _mmpp(process: ArrivalProcess, duration_s: float, rng: np.random.Generator) -> np.ndarray:
    """Alternate calm and burst states with exponential dwell times; Poisson arrivals within each."""
    chunks: list[np.ndarray] = []
    now_s = 0.0
    in_burst = False
    while now_s < duration_s:
        dwell_s = rng.exponential(process.mean_burst_s if in_burst else process.mean_calm_s)
        end_s = min(duration_s, now_s + dwell_s)
        rate_rps = process.burst_rate_rps if in_burst else process.rate_rps
        count = rng.poisson(rate_rps * (end_s - now_s))
        chunks.append(rng.uniform(now_s, end_s, size=count))
        now_s = end_s
        in_burst = not in_burst
    return np.sort(np.concatenate(chunks)) if chunks else np.empty(0)


def diurnal_rate(process: ArrivalProcess, at_s: np.ndarray | float) -> np.ndarray | float:
    """Instantaneous rate: a sinusoid around the mean with the given peak-to-trough ratio."""
    amplitude = (process.peak_to_trough - 1) / (process.peak_to_trough + 1)
    phase = 2 * math.pi * (np.asarray(at_s) - process.peak_at_s) / process.period_s
    return process.rate_rps * (1 + amplitude * np.cos(phase))


def _diurnal(process: ArrivalProcess, duration_s: float, rng: np.random.Generator) -> np.ndarray:
    """Non-homogeneous Poisson by thinning a Poisson process at the peak rate."""
    peak_rps = float(diurnal_rate(process, process.peak_at_s))
    candidates = _renewal(rng.exponential, (1.0 / peak_rps,), peak_rps, duration_s)
    keep = rng.uniform(size=candidates.size) * peak_rps < diurnal_rate(process, candidates)
    return candidates[keep]
