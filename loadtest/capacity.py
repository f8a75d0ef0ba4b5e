"""Capacity at SLO: the highest rate multiplier at which a run keeps its objectives (pure, no I/O).

``search_capacity`` asks an ``attainment_at(multiplier, seed)`` function (one simulated or live run
per call) for SLO attainment at a few load multipliers: it brackets (doubles until a point fails,
halves until one passes), then bisects geometrically until the passing and failing multipliers are
within ``resolution`` of each other. A point passes when the minimum of its overall attainment, its
per-tier attainments and its per-window attainments (the phases of a scenario, 5-minute windows of
a trace) is at least the threshold, so a good first half cannot hide a failing second half. Every
call gets the same seed, so the points differ only in load; ``over_draws`` judges each point on
several seeds' runs pooled. ``smallest_passing`` is the same idea over an integer (the number of GPUs
a policy needs for the nominal rate).

``attainment_of`` turns per-request results (arrival, tier, met its SLO) into an ``Attainment``;
whether one request met its tier's objectives is decided where it ran (kernels.tiers).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

DEFAULT_THRESHOLD = 0.90
DEFAULT_RESOLUTION = 0.02  # relative: stop when failing / passing multiplier <= 1.02
DEFAULT_MAX_POINTS = 16
TRACE_WINDOW_S = 300.0
# a tier or window with fewer requests than this is reported but does not gate: one unlucky request
# of three is not a 67% attainment anyone can act on
MIN_GATING_REQUESTS = 30


@dataclass(frozen=True, slots=True)
class Part:
    """Attainment of one slice of the run: a tier, a scenario phase or a trace window."""

    kind: str  # "tier", "phase" or "window"
    name: str
    attainment: float
    num_requests: int
    gates: bool  # counts towards the minimum (enough requests to judge)


@dataclass(frozen=True, slots=True)
class Attainment:
    overall: float
    num_requests: int
    parts: tuple[Part, ...] = ()
    num_dropped: int = 0  # requests no replica could hold or a forced stop cut off (set by the caller that ran it)

    @property
    def worst(self) -> float:
        """The minimum that must stay at or above the threshold: overall and every gating part."""
        return min([self.overall, *(p.attainment for p in self.parts if p.gates)])

    @property
    def binding(self) -> str:
        """Which slice sets ``worst`` ("overall", or e.g. "phase 600-1800 s")."""
        worst = min((p for p in self.parts if p.gates), key=lambda p: p.attainment, default=None)
        return "overall" if worst is None or worst.attainment >= self.overall else f"{worst.kind} {worst.name}"

    def to_json(self) -> dict[str, object]:
        return {
            "overall": round(self.overall, 4), "worst": round(self.worst, 4), "binding": self.binding,
            "num_requests": self.num_requests, "num_dropped": self.num_dropped,
            "parts": [{"kind": p.kind, "name": p.name, "attainment": round(p.attainment, 4),
                       "num_requests": p.num_requests, "gates": p.gates} for p in self.parts],
        }


@dataclass(frozen=True, slots=True)
class CurvePoint:
    multiplier: float
    rate_rps: float
    attainment: Attainment
    passed: bool


@dataclass(frozen=True, slots=True)
class CapacityResult:
    multiplier: float  # highest passing multiplier; 0 when even the smallest one tried failed
    nominal_rate_rps: float  # the workload's rate at multiplier 1
    threshold: float
    resolution: float
    curve: tuple[CurvePoint, ...]  # every point evaluated, by multiplier
    note: str  # why the search stopped where it did, when that is not "bracketed and bisected"

    @property
    def rate_rps(self) -> float:
        return self.multiplier * self.nominal_rate_rps

    def to_json(self) -> dict[str, object]:
        return {
            "capacity_multiplier": round(self.multiplier, 4), "capacity_rps": round(self.rate_rps, 3),
            "nominal_rate_rps": round(self.nominal_rate_rps, 3), "threshold": self.threshold,
            "resolution": self.resolution, "note": self.note,
            "curve": [{"multiplier": round(p.multiplier, 4), "rate_rps": round(p.rate_rps, 3), "passed": p.passed,
                       **p.attainment.to_json()} for p in self.curve],
        }


def search_capacity(
    attainment_at: Callable[[float, int], Attainment],
    nominal_rate_rps: float,
    seed: int,
    threshold: float = DEFAULT_THRESHOLD,
    resolution: float = DEFAULT_RESOLUTION,
    start: float = 1.0,
    min_multiplier: float = 1 / 64,
    max_multiplier: float = 64.0,
    max_points: int = DEFAULT_MAX_POINTS,
    on_point: Callable[[CurvePoint], None] = lambda point: None,
    can_run: Callable[[float], bool] = lambda multiplier: True,
) -> CapacityResult:
    """Bracket, then bisect (geometric midpoints, since the resolution is relative) to ``resolution``.

    Stops early, saying so in ``note``, when the smallest multiplier fails (capacity 0), the largest
    passes (capacity is at least that), or ``max_points`` runs have been spent or ``can_run`` refuses
    the next multiplier (a live search's time budget): the best bracket so far.
    """
    if not 0 < threshold <= 1:
        raise ValueError(f"threshold must be in (0, 1], got {threshold}")
    if not resolution > 0:
        raise ValueError(f"resolution must be > 0, got {resolution}")
    if not 0 < min_multiplier <= start <= max_multiplier:
        raise ValueError(f"need 0 < min_multiplier <= start <= max_multiplier, got {min_multiplier}, {start}, {max_multiplier}")
    if max_points < 1:
        raise ValueError(f"max_points must be >= 1, got {max_points}")
    curve: dict[float, CurvePoint] = {}

    def passes(multiplier: float) -> bool:
        if multiplier not in curve:
            attainment = attainment_at(multiplier, seed)
            curve[multiplier] = CurvePoint(multiplier, multiplier * nominal_rate_rps, attainment, attainment.worst >= threshold)
            on_point(curve[multiplier])
        return curve[multiplier].passed

    def spent(multiplier: float) -> str:
        """Why the next run may not start ("" when it may)."""
        if len(curve) >= max_points:
            return f"at {max_points} points"
        return "" if can_run(multiplier) else f"by the time budget after {len(curve)} points"

    def result(multiplier: float, note: str) -> CapacityResult:
        points = tuple(curve[m] for m in sorted(curve))
        return CapacityResult(multiplier, nominal_rate_rps, threshold, resolution, points, note)

    passing: float | None = None  # highest multiplier known to pass
    failing: float | None = None  # lowest multiplier known to fail
    multiplier = start
    while passing is None or failing is None:
        if why := spent(multiplier):
            return result(passing or 0.0, f"stopped {why} before bracketing")
        if passes(multiplier):
            passing = multiplier
            if multiplier >= max_multiplier:
                return result(multiplier, f"passes at the largest multiplier tried ({max_multiplier:g}): capacity is at least that")
            multiplier = min(multiplier * 2, max_multiplier)
        else:
            failing = multiplier
            if multiplier <= min_multiplier:
                return result(0.0, f"fails even at the smallest multiplier ({min_multiplier:g}): capacity 0")
            multiplier = max(multiplier / 2, min_multiplier)
    while failing / passing > 1 + resolution:
        middle = math.sqrt(passing * failing)
        if why := spent(middle):
            return result(passing, f"stopped {why}; capacity between {passing:.4g} and {failing:.4g}")
        if passes(middle):
            passing = middle
        else:
            failing = middle
    return result(passing, "")


@dataclass(frozen=True, slots=True)
class PartCapacity:
    """One slice's (e.g. one tier's) capacity read off a search's curve, at the points the search ran."""

    multiplier: float  # highest point up to which the slice kept the threshold at every point; 0 if not even the lowest
    at_least: bool  # it kept it at every point, so its own capacity may be higher than any point run
    attainment: float | None  # its attainment at the search's capacity point (None: capacity 0, or the slice absent)


def part_capacity(result: CapacityResult, kind: str, name: str) -> PartCapacity:
    """How far one slice alone holds the threshold along ``result``'s curve: a bound from the points the
    whole search ran (a separate search per slice would cost as many runs again)."""
    def attainment_at(point: CurvePoint) -> float | None:
        return next((p.attainment for p in point.attainment.parts if p.kind == kind and p.name == name), None)

    multiplier, held_throughout = 0.0, bool(result.curve)
    for point in result.curve:
        value = attainment_at(point)
        if value is not None and value < result.threshold:
            held_throughout = False
            break
        multiplier = point.multiplier
    at_capacity = next((attainment_at(p) for p in result.curve if p.multiplier == result.multiplier), None)
    return PartCapacity(multiplier, held_throughout, at_capacity)


def pooled(draws: Sequence[Attainment], min_gating_requests: int = MIN_GATING_REQUESTS) -> Attainment:
    """Several draws of one point judged as one run: every draw's requests together, so overall, each
    tier's and each window's attainment is the request-weighted mean over the draws. A slice gates when
    it has ``min_gating_requests`` per draw it appears in, the bar one draw is held to."""
    if not draws:
        raise ValueError("no draws to pool")
    if len(draws) == 1:
        return draws[0]
    num = sum(a.num_requests for a in draws)
    overall = sum(a.overall * a.num_requests for a in draws) / num if num else 1.0
    key_to_parts: dict[tuple[str, str], list[Part]] = {}
    for attainment in draws:
        for part in attainment.parts:
            key_to_parts.setdefault((part.kind, part.name), []).append(part)
    parts = []
    for (kind, name), same in key_to_parts.items():
        size = sum(p.num_requests for p in same)
        mean = sum(p.attainment * p.num_requests for p in same) / size if size else 1.0
        parts.append(Part(kind, name, mean, size, size >= min_gating_requests * len(same)))
    return Attainment(overall, num, tuple(parts), sum(a.num_dropped for a in draws))


def over_draws(attainment_at: Callable[[float, int], Attainment], num_draws: int) -> Callable[[float, int], Attainment]:
    """``attainment_at`` run on ``num_draws`` consecutive seeds from the point's seed, pooled: every
    point sees the same draws, so the points still differ only in load. One draw decides a point within
    its own noise: an adaptive run near the threshold moved 12 points with a 1e-6 change of the
    multiplier (fleet/README.md)."""
    if num_draws < 1:
        raise ValueError(f"draws must be >= 1, got {num_draws}")
    return lambda multiplier, seed: pooled([attainment_at(multiplier, seed + k) for k in range(num_draws)])


def smallest_passing(passes: Callable[[int], bool], low: int, high: int) -> int | None:
    """The smallest integer in [low, high] for which ``passes`` holds, assuming it is monotone (more
    GPUs never hurt); None when even ``high`` fails. Asks about O(log(high - low)) values."""
    if low > high:
        raise ValueError(f"empty range [{low}, {high}]")
    if not passes(high):
        return None
    while low < high:
        middle = (low + high) // 2
        if passes(middle):
            high = middle
        else:
            low = middle + 1
    return high


def phase_bounds_s(duration_s: float, onsets_s: Sequence[float]) -> tuple[float, ...]:
    """Window edges at a scenario's drift onsets: [0, onset, ..., duration]."""
    inner = sorted(t for t in set(onsets_s) if 0 < t < duration_s)
    return (0.0, *inner, duration_s)


def window_bounds_s(duration_s: float, window_s: float = TRACE_WINDOW_S) -> tuple[float, ...]:
    """Fixed windows for a trace (which has no phases): [0, w, 2w, ..., duration]."""
    if not window_s > 0:
        raise ValueError(f"window must be > 0 s, got {window_s}")
    edges = [float(t) for t in np.arange(0.0, duration_s, window_s)]
    return (*edges, duration_s) if edges else (0.0, duration_s)


def attainment_of(
    arrivals_s: np.ndarray,
    tiers: Sequence[str],
    met_slo: np.ndarray,
    bounds_s: Sequence[float],
    window_kind: str = "phase",
    min_gating_requests: int = MIN_GATING_REQUESTS,
) -> Attainment:
    """Overall, per-tier and per-window (arrivals in [bounds[i], bounds[i+1]); the last one closed)
    attainment of one run. A request that was shed, dropped or never finished did not meet its SLO."""
    num = len(met_slo)
    if num == 0:
        return Attainment(1.0, 0)
    met = np.asarray(met_slo, dtype=bool)
    tier_array = np.asarray(tiers)
    parts = [_part("tier", str(tier), met[tier_array == tier], min_gating_requests) for tier in sorted(set(tiers))]
    which = np.clip(np.searchsorted(np.asarray(bounds_s), arrivals_s, side="right") - 1, 0, len(bounds_s) - 2)
    for index in range(len(bounds_s) - 1):
        name = f"{bounds_s[index]:.0f}-{bounds_s[index + 1]:.0f} s"
        parts.append(_part(window_kind, name, met[which == index], min_gating_requests))
    return Attainment(float(met.mean()), num, tuple(parts))


def _part(kind: str, name: str, met: np.ndarray, min_gating_requests: int) -> Part:
    return Part(kind, name, float(met.mean()) if met.size else 1.0, int(met.size), met.size >= min_gating_requests)
