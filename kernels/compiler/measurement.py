"""What a probe measured on a real replica, and what it measured it on.

A probe (loadtest/probe.py) starts a candidate configuration, replays the shape open loop at a ladder
of rates and reports one `ProbeStep` per rate; `Measurement` is the ladder's result. `ProbeLadder`
decides the next rate from the steps so far (climb by `factor` until a step misses, then one
bisection between the highest passing and the lowest failing rate); it is pure, so a test drives it
with made-up steps. `ProbeFingerprint` names what a measurement is only valid for: the engine and
its version, the hardware and the model's weights."""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass


@dataclass(frozen=True, slots=True)
class ProbeStep:
    """One rate of the ladder: `num_requests` Poisson arrivals of the shape, open loop."""

    rate_rps: float
    num_requests: int
    num_ok: int
    attainment: float  # share of requests that met both the TTFT and the TPOT objective
    ttft_p50_s: float
    ttft_p99_s: float
    tpot_p50_s: float
    tpot_p99_s: float
    throughput_tokens_s: float  # prompt + output tokens of answered requests / the step's wall time
    wall_s: float


@dataclass(frozen=True, slots=True)
class Measurement:
    """A candidate's measured figures. Latencies and throughput are those of the goodput step (the
    highest rate whose attainment reached the threshold), or of the lowest rate tried when none did."""

    goodput_rps: float
    ttft_p50_s: float
    ttft_p99_s: float
    tpot_p50_s: float
    tpot_p99_s: float
    throughput_tokens_s: float
    attainment: float
    steps: tuple[ProbeStep, ...]
    wall_s: float  # start of the server to its stop

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, object]) -> Measurement:
        steps = tuple(ProbeStep(**step) for step in values["steps"])  # type: ignore[attr-defined]
        return cls(**{**values, "steps": steps})  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class ProbeFingerprint:
    """What a measurement holds for: the engine and its version, the hardware (GPU kind, or CPU model
    and thread count) and the digest of the model file."""

    engine: str
    engine_version: str
    hardware: str
    weights_sha256: str

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]

    def to_dict(self) -> dict[str, str]:
        return {**asdict(self), "digest": self.digest()}


@dataclass(frozen=True, slots=True)
class ProbeLadder:
    """The rates a probe tries: `start_rps`, then up (or down, when the first step misses) by `factor`
    until the outcome flips, then one bisection step at the geometric mean; at most `max_steps`, and at most `max_steps_down` below
    the start (goodput 0 then means: below the lowest rate tried)."""

    start_rps: float
    factor: float = 2.0
    max_steps: int = 5
    requests_per_step: int = 12
    min_attainment: float = 0.9
    max_steps_down: int = 2  # a step's wall time grows as its rate falls

    def __post_init__(self) -> None:
        if not self.start_rps > 0 or not self.factor > 1 or self.max_steps < 1 or self.requests_per_step < 1:
            raise ValueError(f"a probe ladder needs start_rps > 0, factor > 1, max_steps >= 1 and requests_per_step >= 1; got {self}")
        if not 0 < self.min_attainment <= 1:
            raise ValueError(f"min_attainment must be in (0, 1], got {self.min_attainment}")

    def passes(self, step: ProbeStep) -> bool:
        return step.attainment >= self.min_attainment

    def next_rate(self, steps: Sequence[ProbeStep]) -> float | None:
        """The next rate to try, None when the ladder is done."""
        if not steps:
            return self.start_rps
        if len(steps) >= self.max_steps:
            return None
        passed = [s.rate_rps for s in steps if self.passes(s)]
        failed = [s.rate_rps for s in steps if not self.passes(s)]
        if not failed:
            return max(passed) * self.factor
        if not passed:
            lower = min(failed) / self.factor
            return lower if lower >= self.start_rps / self.factor**self.max_steps_down * 0.999 else None
        low = max(passed)
        high = min((rate for rate in failed if rate > low), default=None)
        if high is None or high / low <= math.sqrt(self.factor) * 1.001:
            return None  # a pass above every miss (noise), or already bisected once
        return math.sqrt(low * high)

    def result(self, steps: Sequence[ProbeStep], wall_s: float) -> Measurement:
        """Goodput is the highest passing rate (0 when none passed); the figures are that step's."""
        if not steps:
            raise ValueError("a measurement needs at least one step")
        passed = [s for s in steps if self.passes(s)]
        at = max(passed, key=lambda s: s.rate_rps) if passed else min(steps, key=lambda s: s.rate_rps)
        return Measurement(
            goodput_rps=at.rate_rps if passed else 0.0, ttft_p50_s=at.ttft_p50_s, ttft_p99_s=at.ttft_p99_s,
            tpot_p50_s=at.tpot_p50_s, tpot_p99_s=at.tpot_p99_s, throughput_tokens_s=at.throughput_tokens_s,
            attainment=at.attainment, steps=tuple(sorted(steps, key=lambda s: s.rate_rps)), wall_s=wall_s,
        )


@dataclass(frozen=True, slots=True)
class ProbeCorrection:
    """A measured correction to the performance model for one fingerprint (engine and version, hardware,
    weights) and model: measured goodput / predicted goodput, fitted by `polymorph kernels fit --store`
    (kernels/compiler/probe_fit.py). The errors are median absolute percentage errors of the predicted
    goodput, before (the model alone) and after (times `goodput_factor`), on the trials it was fitted on
    and on the trials held back from the fit (None: no trial was held back)."""

    fingerprint: str  # ProbeFingerprint.digest()
    model: str
    goodput_factor: float
    num_fit: int
    num_held_back: int
    num_censored: int  # trials whose measured goodput was 0 (below the lowest rate tried): no ratio to fit
    fit_before_pct: float
    fit_after_pct: float
    held_back_before_pct: float | None
    held_back_after_pct: float | None
    fitted_at: float  # wall-clock seconds

    def goodput_rps(self, predicted_rps: float) -> float:
        return predicted_rps * self.goodput_factor

    def to_dict(self) -> dict[str, object]:
        return asdict(self)
