"""Judge a canary: one replica of a live pool on a new configuration against its unchanged siblings.

Both sides serve the pool's live traffic over the same window (fleet.replica_outcomes). The figure
compared is seconds per completion token (``ReplicaFigures.s_per_token``: queueing in the engine, a
slower prefill or decode raise it). Replicas on the same configuration differ too (the requests they
drew, the machine's other work), so the canary must beat its siblings by more than that noise: with
two or more siblings, their own relative spread over the window. With one, an A/A window before the
canary started (both on the old configuration) gives the canary's slot's ratio to its sibling, which
the trial's ratio is measured against (a slot that was already faster gets no credit for it), and
the noise: that ratio's sampling error from every request's own time per token (``aa_noise``). The
margin is the larger of that noise and ``min_margin``.

The verdict: ``wait`` while either side has fewer than ``min_requests`` (until ``max_windows``
windows have passed: then ``roll back``); ``roll back`` when the canary failed a larger share of its
requests, met its SLO on a share lower by more than the margin, or is not faster by more than the
margin; else ``adopt``. Pure: the caller passes figures in and applies the verdict.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fleet.replica_outcomes import ReplicaFigures, pooled

ADOPT, ROLL_BACK, WAIT = "adopt", "roll back", "wait"


@dataclass(frozen=True, slots=True)
class CanarySettings:
    """``fleet.controller.canary``: ``enabled`` makes the controller's in-place recompiles of a pool with
    two or more replicas trial one replica first; ``POST /admin/canary`` uses the other fields either way."""

    enabled: bool = False
    window_s: float = 120.0  # fleet seconds each side is measured for (and the A/A window with one sibling)
    min_requests: int = 20  # finished requests each side needs in the window before it is judged
    min_margin: float = 0.05  # the least relative gain that adopts, whatever the noise
    max_windows: float = 3.0  # a side still short of min_requests after this many windows: rolled back

    def __post_init__(self) -> None:
        if self.window_s <= 0 or self.min_requests < 1 or not 0 <= self.min_margin < 1 or self.max_windows < 1:
            raise ValueError("window_s > 0, min_requests >= 1, 0 <= min_margin < 1 and max_windows >= 1 are required")


@dataclass(frozen=True, slots=True)
class Noise:
    """The relative spread of ``s_per_token`` between replicas on one configuration, and where it was measured."""

    spread: float
    source: str  # "siblings" (their spread over the trial window) or "a/a" (canary slot and sibling before the trial)
    figures: tuple[ReplicaFigures, ...]
    ratio: float | None = None  # a/a: the canary slot's s_per_token over its sibling's on the old configuration


@dataclass(frozen=True, slots=True)
class CanaryVerdict:
    outcome: str  # ADOPT, ROLL_BACK or WAIT
    reason: str
    canary: ReplicaFigures
    siblings: tuple[ReplicaFigures, ...]
    noise: Noise | None  # None: the trial ended before a verdict (too few requests in the A/A window, the canary gone)
    margin: float | None
    gain: float | None  # 1 - canary s_per_token / siblings' pooled s_per_token

    def to_json(self) -> dict[str, Any]:
        """The figures of both sides, the noise and the margin, as the ``canary`` decision logs them."""
        return {"canary_figures": self.canary.to_json(), "sibling_figures": {f.slot: f.to_json() for f in self.siblings},
                "noise": None if self.noise is None else round(self.noise.spread, 4),
                "noise_source": None if self.noise is None else self.noise.source,
                "noise_figures": None if self.noise is None else {f.slot: f.to_json() for f in self.noise.figures},
                "aa_ratio": None if self.noise is None or self.noise.ratio is None else round(self.noise.ratio, 4),
                "margin": None if self.margin is None else round(self.margin, 4), "gain": None if self.gain is None else round(self.gain, 4)}


def spread(figures: Sequence[ReplicaFigures]) -> float | None:
    """(max - min) / mean of the replicas' ``s_per_token``; None with fewer than two that have one."""
    values = [f.s_per_token for f in figures if f.s_per_token is not None]
    if len(values) < 2:
        return None
    mean = sum(values) / len(values)
    return (max(values) - min(values)) / mean if mean > 0 else 0.0


def aa_noise(canary_slot: ReplicaFigures, sibling: ReplicaFigures) -> Noise | None:
    """The A/A noise of the canary's slot and its sibling on one configuration: their ratio, and its sampling
    noise from every request (relative standard error ``sqrt(cv_a^2 / n_a + cv_b^2 / n_b)``) taken twice, for the
    trial's ratio carries as much, at two standard errors: a gain inside it is not shown to be one. None while
    a side has no ratio or no spread yet."""
    ratio = _ratio(canary_slot, sibling)
    if ratio is None or canary_slot.cv is None or sibling.cv is None:
        return None
    error = math.sqrt(canary_slot.cv ** 2 / canary_slot.num_requests + sibling.cv ** 2 / sibling.num_requests)
    return Noise(2.0 * math.sqrt(2.0) * error, "a/a", (canary_slot, sibling), ratio)


def _ratio(a: ReplicaFigures, b: ReplicaFigures) -> float | None:
    if a.s_per_token is None or b.s_per_token is None or b.s_per_token <= 0:
        return None
    return a.s_per_token / b.s_per_token


def enough(figures: Sequence[ReplicaFigures], settings: CanarySettings) -> bool:
    """Every replica finished ``min_requests`` and produced tokens: its ``s_per_token`` means something."""
    return all(f.num_requests >= settings.min_requests and f.s_per_token is not None for f in figures)


def judge(canary: ReplicaFigures, siblings: tuple[ReplicaFigures, ...], aa_noise: Noise | None, windows_waited: float,
          settings: CanarySettings) -> CanaryVerdict:
    """The verdict on ``canary`` against ``siblings`` over the same window (see the module doc).
    ``aa_noise`` is required with one sibling; ``windows_waited`` is the trial's age in windows."""
    if not siblings:
        raise ValueError("a canary needs at least one sibling on the old configuration")
    if len(siblings) >= 2:
        noise = Noise(spread(siblings) or 0.0, "siblings", siblings)
    elif aa_noise is not None:
        noise = aa_noise
    else:
        raise ValueError("one sibling: the noise must come from an A/A window")
    margin = max(settings.min_margin, noise.spread)
    others = pooled("siblings", siblings)
    gain = None  # the figures so far, logged with a verdict on too few requests too
    if canary.s_per_token is not None and others.s_per_token:
        ratio = noise.ratio if len(siblings) == 1 and noise.ratio else 1.0  # a/a: against what the slot did beside this sibling before
        gain = 1.0 - canary.s_per_token / others.s_per_token / ratio

    def verdict(outcome: str, reason: str) -> CanaryVerdict:
        return CanaryVerdict(outcome, reason, canary, siblings, noise, margin, gain)

    if not enough((canary, *siblings), settings) or gain is None:
        if windows_waited >= settings.max_windows:
            return verdict(ROLL_BACK, f"fewer than {settings.min_requests} requests on a side after {windows_waited:.1f} windows: "
                                      "no evidence the new configuration is better")
        return verdict(WAIT, f"fewer than {settings.min_requests} requests on a side")
    if canary.failed_share > others.failed_share:
        return verdict(ROLL_BACK, f"the canary failed {canary.failed_share:.1%} of its requests, its siblings {others.failed_share:.1%}")
    if canary.slo_share < others.slo_share - margin:
        return verdict(ROLL_BACK, f"the canary met its SLO on {canary.slo_share:.1%} of its requests, its siblings on {others.slo_share:.1%}")
    if gain > margin:
        return verdict(ADOPT, f"the canary is {gain:.1%} faster per token than its siblings, over the {margin:.1%} margin")
    return verdict(ROLL_BACK, f"the canary is {gain:.1%} faster per token than its siblings, not over the {margin:.1%} margin "
                              f"({noise.source} noise {noise.spread:.1%})")
