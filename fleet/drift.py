"""Decide whether the live traffic mix has left the mix the current plan was made for.

Three signals, each divided by its threshold so that 1.0 means "changed enough":

* divergence: Jensen-Shannon divergence (base 2, in [0, 1]) between the shapes' shares of *work*
  (requests times prompt + output tokens), since a few long-context requests weigh more than many
  short chats;
* rate change: ``|log(live rate / planned rate)|`` of the total arrival rate;
* profile change: the largest ``|log|`` ratio of a shape's mean prompt or output length (a shape
  whose requests got longer needs more capacity even at the same rate), for shapes with a real share.

A surge is also judged on the last ``strong_dwell_s`` alone: when that span's total rate (of at least
``SURGE_MIN_REQUESTS`` requests) scores ``strong_score`` against the plan's, it is the score. A flash crowd
of 7x the rate moves a 120 s window's mean far enough only after about 40 s, most of a two-minute burst.

Drift fires only when the score (the largest of the three) has stayed at or above 1 for ``dwell_s``
(``strong_dwell_s`` once it reaches ``strong_score``),
at least ``min_interval_s`` after the last plan and once the window is warm. It re-arms only after the
score has dropped below ``rearm_below`` (hysteresis), so a mix that hovers at the threshold cannot
flap. Pure: the caller passes ``now`` and both mixes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fleet.telemetry import TrafficMix

# A rate read from n requests is off by about 1/sqrt(n) by chance: from 50, a strong score (2.86x or
# 0.35x the plan's rate) is more than 10 standard deviations away, so a surge of noise cannot fire.
SURGE_MIN_REQUESTS = 50


@dataclass(frozen=True, slots=True)
class DriftSettings:
    divergence_threshold: float = 0.05
    rate_change_threshold: float = math.log(1.3)  # +30% or -23% of the total rate
    profile_change_threshold: float = math.log(1.5)
    min_profile_share: float = 0.05  # shapes below this share of work do not count for profile change
    dwell_s: float = 30.0
    # A score this strong is no noise: it fires after strong_dwell_s. The plan made from so short a sample
    # moves replicas between pools only and is made again once the window holds only the new mix
    # (fleet.controller's refine); before that refine existed a 10 s dwell planned too little (fleet/README.md).
    strong_score: float = 4.0
    strong_dwell_s: float = 10.0
    min_interval_s: float = 120.0
    warmup_s: float = 60.0
    rearm_below: float = 0.7

    def __post_init__(self) -> None:
        for name in ("divergence_threshold", "rate_change_threshold", "profile_change_threshold"):
            if not getattr(self, name) > 0:
                raise ValueError(f"drift {name} must be > 0")
        if not (0 <= self.strong_dwell_s <= self.dwell_s and self.strong_score >= 1):
            raise ValueError("drift strong_dwell_s must be in [0, dwell_s] and strong_score >= 1")
        if not 0 < self.rearm_below <= 1:
            raise ValueError("drift rearm_below must be in (0, 1]")

    def warmed_up(self, covered_s: float) -> bool:
        """The telemetry window holds enough traffic to act on (``covered_s`` of it): the detector's judgement,
        and the gateway's first model of its ``urls`` pools (gateway.pool_modeller), wait for the same warm-up."""
        return covered_s >= self.warmup_s


@dataclass(frozen=True, slots=True)
class DriftScore:
    divergence: float
    rate_change: float
    profile_change: float
    score: float
    reason: str


@dataclass(frozen=True, slots=True)
class DriftVerdict:
    at: float
    score: DriftScore
    above_since: float


def work_shares(mix: TrafficMix) -> dict[str, float]:
    work = {s.name: s.rate_rps * (s.mean_prompt_tokens + s.mean_output_tokens) for s in mix.shapes}
    total = sum(work.values())
    return {name: w / total for name, w in work.items()} if total > 0 else {}


def js_divergence(p: dict[str, float], q: dict[str, float]) -> float:
    """Jensen-Shannon divergence in bits (0 for equal distributions, 1 for disjoint ones)."""
    total = 0.0
    for key in p.keys() | q.keys():
        a, b = p.get(key, 0.0), q.get(key, 0.0)
        m = (a + b) / 2
        if a > 0:
            total += a * math.log2(a / m) / 2
        if b > 0:
            total += b * math.log2(b / m) / 2
    return max(0.0, total)


def rate_change(live: TrafficMix, planned: TrafficMix) -> float:
    """``|log(live rate / planned rate)|`` of the total arrival rate (inf when only one of them is 0)."""
    if live.total_rate_rps > 0 and planned.total_rate_rps > 0:
        return abs(math.log(live.total_rate_rps / planned.total_rate_rps))
    return 0.0 if live.total_rate_rps == planned.total_rate_rps else math.inf


def score(live: TrafficMix, planned: TrafficMix, settings: DriftSettings) -> DriftScore:
    live_shares, planned_shares = work_shares(live), work_shares(planned)
    divergence = js_divergence(live_shares, planned_shares)
    profile_change = 0.0
    for load in live.shapes:
        before = planned.shape(load.name)
        if before is None or live_shares.get(load.name, 0.0) < settings.min_profile_share:
            continue
        for now_v, then_v in ((load.mean_prompt_tokens, before.mean_prompt_tokens), (load.mean_output_tokens, before.mean_output_tokens)):
            if now_v > 0 and then_v > 0:
                profile_change = max(profile_change, abs(math.log(now_v / then_v)))
    rate = rate_change(live, planned)
    parts = {
        "mix divergence": divergence / settings.divergence_threshold,
        "rate change": rate / settings.rate_change_threshold,
        "length profile change": profile_change / settings.profile_change_threshold,
    }
    reason = max(parts, key=lambda k: parts[k])
    return DriftScore(divergence, rate, profile_change, parts[reason], reason)


def with_surge(current: DriftScore, recent: TrafficMix | None, planned: TrafficMix, settings: DriftSettings) -> DriftScore:
    """``current``, or the rate change over ``recent`` (the last ``strong_dwell_s``) when that alone is a
    strong score above it: a flash crowd is acted on after the strong dwell, not once the window's mean moves.
    Only the total rate: shares and lengths of a few seconds' requests are too noisy to act on."""
    if recent is None or recent.total_rate_rps * recent.window_s < SURGE_MIN_REQUESTS or planned.total_rate_rps <= 0:
        return current
    rate = rate_change(recent, planned)
    surge = rate / settings.rate_change_threshold
    if surge < settings.strong_score or surge <= current.score:
        return current
    return DriftScore(current.divergence, rate, current.profile_change, surge, "rate change")


class DriftDetector:
    """Hysteresis and dwell around ``score``; one instance per controller."""

    def __init__(self, settings: DriftSettings) -> None:
        self.settings = settings
        self.armed = True
        self.above_since: float | None = None
        self.last_plan_at = -math.inf

    def on_plan(self, now: float) -> None:
        """A new plan was adopted: its mix becomes the reference and the dwell clock restarts."""
        self.last_plan_at = now
        self.above_since = None
        self.armed = True

    def observe(self, now: float, live: TrafficMix, planned: TrafficMix, covered_s: float,
                recent: TrafficMix | None = None) -> tuple[DriftScore, DriftVerdict | None]:
        """``recent``: the last ``strong_dwell_s`` of ``live``, where a surge shows first (``with_surge``)."""
        s = self.settings
        current = with_surge(score(live, planned, s), recent, planned, s)
        if current.score < s.rearm_below:
            self.armed = True
        if current.score < 1.0:
            self.above_since = None
            return current, None
        if self.above_since is None:
            self.above_since = now
        ready = (
            self.armed
            and s.warmed_up(covered_s)
            and now - self.above_since >= (s.strong_dwell_s if current.score >= s.strong_score else s.dwell_s)
            and now - self.last_plan_at >= s.min_interval_s
        )
        if not ready:
            return current, None
        self.armed = False
        return current, DriftVerdict(now, current, self.above_since)
