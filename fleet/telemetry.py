"""Sense: a sliding-window traffic mix per shape and SLO attainment per pool, O(1) per record.

The gateway calls ``record_arrival`` when it has classified a request and ``record_outcome`` when the
response ends; the simulator calls the same two methods on its virtual clock. Time is bucketed
(``bucket_s``) in a ring of ``window_s / bucket_s`` buckets, so a record is a few dict updates and a
window is a sum over the ring. Arrivals, not completions, measure demand: under overload completions
only show what the fleet managed to serve. An outcome carries the prompt tokens its engine counted and
those it served from a prefix cache (the response's ``usage.prompt_tokens`` and
``usage.prompt_tokens_details.cached_tokens``; both the engine's, as a tokenizer of the gateway's own
would count differently): the capacity model prices a shape with that share of its prompts cached.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fleet.lengths import add_counts, equal_mass_points, length_bin
from kernels.config import MAX_PREFIX_SHARE


@dataclass(frozen=True, slots=True)
class ShapeLoad:
    """One shape's traffic over a window."""

    name: str
    rate_rps: float
    mean_prompt_tokens: float
    mean_output_tokens: float
    tier_to_share: tuple[tuple[str, float], ...]
    # equally weighted length points (fleet.lengths); () when only the means are known
    prompt_points: tuple[int, ...] = ()
    output_points: tuple[int, ...] = ()
    prefix_share: float = 0.0  # of its prompt tokens, the share engines served from a prefix cache

    def tier_shares(self) -> dict[str, float]:
        return dict(self.tier_to_share)


@dataclass(frozen=True, slots=True)
class PoolSlo:
    pool: str
    num_requests: int
    num_met: int

    @property
    def attainment(self) -> float:
        return self.num_met / self.num_requests if self.num_requests else 1.0


@dataclass(frozen=True, slots=True)
class TrafficMix:
    """The mix over ``[ended_at - window_s, ended_at)``: per-shape loads, sorted by name."""

    ended_at: float
    window_s: float
    shapes: tuple[ShapeLoad, ...]
    pools: tuple[PoolSlo, ...] = ()

    @property
    def total_rate_rps(self) -> float:
        return sum(s.rate_rps for s in self.shapes)

    def shape(self, name: str) -> ShapeLoad | None:
        for load in self.shapes:
            if load.name == name:
                return load
        return None

    def goodput_rps(self) -> float:
        return sum(p.num_met for p in self.pools) / self.window_s if self.window_s else 0.0

    def to_json(self) -> dict[str, object]:
        return {
            "window_s": self.window_s,
            "shapes": {
                s.name: {"rate_rps": round(s.rate_rps, 3), "prompt_tokens": round(s.mean_prompt_tokens),
                         "output_tokens": round(s.mean_output_tokens), "prompt_points": list(s.prompt_points),
                         "output_points": list(s.output_points), "prefix_share": round(s.prefix_share, 3),
                         "tiers": dict(s.tier_to_share)}
                for s in self.shapes
            },
            "pool_attainment": {p.pool: round(p.attainment, 4) for p in self.pools},
        }


def mix_from_counts(
    ended_at: float,
    window_s: float,
    shape_to_counts: Mapping[str, tuple[int, float, float, int, Mapping[str, int], float, float]],
    shape_to_bins: Mapping[str, tuple[Mapping[int, int], Mapping[int, int]]] | None = None,
) -> TrafficMix:
    """Build a mix from per-shape (arrivals, prompt tokens, output tokens, outcomes, tier counts, the
    outcomes' cached prompt tokens, the prompt tokens those were counted among) and, optionally,
    per-shape (prompt, output) length histograms (fleet.lengths bins)."""
    loads = []
    for name in sorted(shape_to_counts):
        num, prompt, output, num_out, tiers, cached, cached_of = shape_to_counts[name]
        if num == 0:
            continue
        shares = tuple(sorted((t, n / num) for t, n in tiers.items() if n))
        prompt_bins, output_bins = (shape_to_bins or {}).get(name, ({}, {}))
        prefix_share = min(MAX_PREFIX_SHARE, cached / cached_of) if cached_of > 0 else 0.0
        loads.append(ShapeLoad(name, num / window_s, prompt / num, output / num_out if num_out else 0.0, shares,
                               equal_mass_points(prompt_bins), equal_mass_points(output_bins), prefix_share))
    return TrafficMix(ended_at, window_s, tuple(loads))


class _Bucket:
    __slots__ = ("shape_to_arrivals", "pool_to_outcomes", "shape_to_outputs")

    def __init__(self) -> None:
        self.shape_to_arrivals: dict[str, list[Any]] = {}  # shape -> [num, prompt_tokens, {tier: num}, {bin: num}]
        # shape -> [num, completion_tokens, {bin: num}, cached prompt tokens, the prompt tokens they were counted among]
        self.shape_to_outputs: dict[str, list[Any]] = {}
        self.pool_to_outcomes: dict[str, list[int]] = {}  # pool -> [num, num_met]


class Telemetry:
    """Ring of time buckets; every method takes ``now`` (seconds on the caller's clock)."""

    def __init__(self, window_s: float = 120.0, bucket_s: float = 5.0) -> None:
        if not (window_s > 0 and bucket_s > 0) or window_s < bucket_s:
            raise ValueError(f"need window_s >= bucket_s > 0, got {window_s} and {bucket_s}")
        self.window_s = window_s
        self.bucket_s = bucket_s
        self._num_buckets = int(math.ceil(window_s / bucket_s))
        self._ring = [_Bucket() for _ in range(self._num_buckets)]
        self._current = -1  # absolute index of the newest bucket
        self._first: int | None = None  # absolute index of the first bucket ever written

    def _bucket(self, now: float) -> _Bucket:
        index = int(now // self.bucket_s)
        if index != self._current:
            if index < self._current:  # a late record (clock skew between workers): count it as current
                return self._ring[self._current % self._num_buckets]
            for stale in range(max(self._current + 1, index - self._num_buckets + 1), index + 1):
                self._ring[stale % self._num_buckets] = _Bucket()
            self._current = index
            if self._first is None:
                self._first = index
        return self._ring[index % self._num_buckets]

    def record_arrival(self, now: float, shape: str, tier: str, prompt_tokens: int) -> None:
        bucket = self._bucket(now)
        entry = bucket.shape_to_arrivals.get(shape)
        if entry is None:
            entry = bucket.shape_to_arrivals[shape] = [0, 0, {}, {}]
        entry[0] += 1
        entry[1] += prompt_tokens
        tiers, bins = entry[2], entry[3]
        tiers[tier] = tiers.get(tier, 0) + 1
        index = length_bin(prompt_tokens)
        bins[index] = bins.get(index, 0) + 1

    def record_outcome(self, now: float, shape: str, pool: str, met_slo: bool, completion_tokens: int, cached_tokens: int = 0,
                       of_prompt_tokens: int = 0) -> None:
        """``cached_tokens`` of the ``of_prompt_tokens`` its engine counted in its prompt came from a prefix
        cache (0 of 0: the engine did not say)."""
        bucket = self._bucket(now)
        out = bucket.shape_to_outputs.get(shape)
        if out is None:
            out = bucket.shape_to_outputs[shape] = [0, 0, {}, 0, 0]
        out[0] += 1
        out[1] += completion_tokens
        out[3] += cached_tokens
        out[4] += of_prompt_tokens
        index = length_bin(completion_tokens)
        out[2][index] = out[2].get(index, 0) + 1
        pool_entry = bucket.pool_to_outcomes.get(pool)
        if pool_entry is None:
            pool_entry = bucket.pool_to_outcomes[pool] = [0, 0]
        pool_entry[0] += 1
        pool_entry[1] += 1 if met_slo else 0

    def windows(self, now: float, span_s: float, sub_s: float) -> tuple[TrafficMix, ...]:
        """The last ``span_s`` (as ``window`` counts it) cut into consecutive mixes of about ``sub_s`` each,
        oldest first: what a plan weighs when bursts matter, not only the mean. A span shorter than 1.5
        of them is one mix."""
        self._bucket(now)
        available = min(self._num_buckets - 1, self._current - (self._first or 0))
        total = min(available, max(1, int(span_s // self.bucket_s)))
        num = max(1, round(total * self.bucket_s / sub_s))
        edges = [round(k * total / num) for k in range(num + 1)]  # complete buckets back from the newest
        return tuple(self.window(now, (edges[k + 1] - edges[k]) * self.bucket_s, before_s=edges[k] * self.bucket_s)
                     for k in reversed(range(num)))

    def covered_s(self, now: float) -> float:
        """How much of the window holds data (less than window_s during warm-up)."""
        if self._first is None:
            return 0.0
        return min(self.window_s, now - self._first * self.bucket_s)

    def window(self, now: float, span_s: float | None = None, before_s: float = 0.0) -> TrafficMix:
        """The mix over the last window, or its last ``span_s`` (complete buckets only, so the newest
        partial bucket cannot bias rates); with ``before_s``, the span that ended that long before."""
        self._bucket(now)
        skip = int(before_s // self.bucket_s)
        num_full = min(self._num_buckets - 1, self._current - (self._first or 0)) - skip
        if span_s is not None:
            num_full = min(num_full, max(1, int(span_s // self.bucket_s)))
        counts: dict[str, tuple[int, float, float, int, dict[str, int], float, float]] = {}
        pools: dict[str, list[int]] = {}
        bins: dict[str, tuple[dict[int, int], dict[int, int]]] = {}
        for back in range(skip + 1, skip + num_full + 1):
            bucket = self._ring[(self._current - back) % self._num_buckets]
            for shape, (num, prompt, tiers, prompt_bins) in bucket.shape_to_arrivals.items():
                n0, p0, o0, no0, t0, c0, of0 = counts.get(shape, (0, 0.0, 0.0, 0, {}, 0.0, 0.0))
                merged = dict(t0)
                for tier, n in tiers.items():
                    merged[tier] = merged.get(tier, 0) + n
                counts[shape] = (n0 + num, p0 + prompt, o0, no0, merged, c0, of0)
                add_counts(bins.setdefault(shape, ({}, {}))[0], prompt_bins)
            for shape, (num_out, tokens, output_bins, cached, cached_of) in bucket.shape_to_outputs.items():
                n0, p0, o0, no0, t0, c0, of0 = counts.get(shape, (0, 0.0, 0.0, 0, {}, 0.0, 0.0))
                counts[shape] = (n0, p0, o0 + tokens, no0 + num_out, t0, c0 + cached, of0 + cached_of)
                add_counts(bins.setdefault(shape, ({}, {}))[1], output_bins)
            for pool, (num, met) in bucket.pool_to_outcomes.items():
                acc = pools.setdefault(pool, [0, 0])
                acc[0] += num
                acc[1] += met
        window_s = num_full * self.bucket_s
        if window_s <= 0:
            return TrafficMix(now, 0.0, ())
        mix = mix_from_counts((self._current - skip) * self.bucket_s, window_s, counts, bins)
        slos = tuple(PoolSlo(name, n, m) for name, (n, m) in sorted(pools.items()))
        return TrafficMix(mix.ended_at, window_s, mix.shapes, slos)
