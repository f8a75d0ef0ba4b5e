"""A bounded time series of the gateway's traffic for the dashboard: the mix by shape, and per tier
the request rate, goodput and TTFT/TPOT p99, in fixed buckets over the last hour.

``record`` runs on the request path, so it is pure Python with no allocation: a ring of
``span_s / step_s`` buckets, one flat ``array`` per label, and latencies kept as counts in a fixed
log-scale histogram (8 bins an octave, so a bin spans at most 12.5 % of its value) plus the exact
maximum. A p99 is the upper edge of the bin holding the 99th-percentile sample, capped by that maximum.
Label sets are capped: shapes and tiers come from the config, and a label past the cap is counted
under ``_other`` so that no caller can grow the store.
"""

from __future__ import annotations

import math
from array import array
from typing import Any

OTHER_LABEL = "_other"

_SUB_BINS = 8
_MIN_EXP = -11  # frexp exponent of the lowest octave: bins start at 2**-12 s (0.24 ms)
_MAX_EXP = 11  # the highest octave ends at 2**11 s (34 min), beyond any deadline
_NUM_BINS = (_MAX_EXP - _MIN_EXP + 1) * _SUB_BINS
# A tier's slot: requests, goodput, errors, the TTFT and TPOT sample counts, then their bins.
_TTFT_COUNT_AT, _TPOT_COUNT_AT = 3, 4
_TTFT_AT = 5
_TPOT_AT = _TTFT_AT + _NUM_BINS
_TIER_WIDTH = _TPOT_AT + _NUM_BINS
_POOL_WIDTH = 2  # requests, goodput
_QUANTILE_PERCENT = 99


def latency_bin(value_s: float) -> int:
    """The histogram bin of a latency; values outside the range land in the edge bins."""
    if value_s <= 0.0:
        return 0
    mantissa, exponent = math.frexp(value_s)
    found = (exponent - _MIN_EXP) * _SUB_BINS + int((mantissa - 0.5) * (2 * _SUB_BINS))
    return 0 if found < 0 else _NUM_BINS - 1 if found >= _NUM_BINS else found


def bin_upper_s(index: int) -> float:
    exponent, sub = divmod(index, _SUB_BINS)
    return math.ldexp(0.5 + (sub + 1) / (2 * _SUB_BINS), exponent + _MIN_EXP)


class _Labels:
    """Label -> flat ring of ``width`` counters a bucket; at most ``max_num`` labels, then ``_other``."""

    __slots__ = ("rings", "max_num", "size")

    def __init__(self, max_num: int, size: int) -> None:
        self.rings: dict[str, array[int]] = {}
        self.max_num = max_num
        self.size = size

    def ring(self, label: str) -> array[int]:
        found = self.rings.get(label)
        if found is None:
            if len(self.rings) >= self.max_num:
                label = OTHER_LABEL
                found = self.rings.get(label)
            if found is None:
                found = array("I", bytes(4 * self.size))
                self.rings[label] = found
        return found


class Series:
    """Counts a bucket of ``step_s`` seconds, kept for ``span_s``; the clock is the caller's (Unix seconds)."""

    def __init__(self, step_s: int = 10, span_s: int = 3600, max_num_shapes: int = 64, max_num_tiers: int = 16, max_num_pools: int = 64) -> None:
        if step_s <= 0 or span_s < step_s:
            raise ValueError(f"need 0 < step_s <= span_s, got step_s={step_s}, span_s={span_s}")
        self.step_s = step_s
        self.span_s = span_s
        self.num_complete = span_s // step_s  # buckets a snapshot can show
        # One more slot than a snapshot shows: the bucket being filled now.
        self.num_slots = n = self.num_complete + 1
        self._slot_index = [-1] * n
        self._latest_index = -1
        self._shapes = _Labels(max_num_shapes, n)
        self._tiers = _Labels(max_num_tiers, n * _TIER_WIDTH)
        self._pools = _Labels(max_num_pools, n * _POOL_WIDTH)
        self._tier_max_s: dict[str, array[float]] = {}  # per tier and slot: the largest TTFT, TPOT
        # Records only go to the newest bucket, so a complete bucket never changes again: its p99s are
        # computed once (per tier and slot: bucket index, ttft p99, tpot p99), and a whole snapshot is
        # reused until the next bucket completes.
        self._tier_p99: dict[str, list[tuple[int, float | None, float | None]]] = {}
        self._snapshot_key: tuple[int, int] = (-1, 0)
        self._snapshot: dict[str, Any] = {}
        self._zero_tier = array("I", bytes(4 * _TIER_WIDTH))
        self._zero_pool = array("I", bytes(4 * _POOL_WIDTH))

    def record(self, now_unix_s: float, shape: str, tier: str, pool: str, ok: bool, met_slo: bool, ttft_s: float | None, tpot_s: float | None) -> None:
        """Count one answered request. A time before the newest bucket (the clock stepped back) is dropped."""
        index = int(now_unix_s // self.step_s)
        slot = index % self.num_slots
        if index != self._latest_index:
            if index < self._latest_index:
                return
            self._advance(index)
        good = ok and met_slo
        # dict.get first: the method call is only paid the first time a label is seen.
        (self._shapes.rings.get(shape) or self._shapes.ring(shape))[slot] += 1
        ring = self._tiers.rings.get(tier) or self._tiers.ring(tier)
        base = slot * _TIER_WIDTH
        ring[base] += 1
        if good:
            ring[base + 1] += 1
        if not ok:
            ring[base + 2] += 1
        if ttft_s is not None or tpot_s is not None:
            maxima = self._tier_max_s.get(tier) or self._new_maxima(tier)
            if ttft_s is not None:
                ring[base + _TTFT_COUNT_AT] += 1
                ring[base + _TTFT_AT + latency_bin(ttft_s)] += 1
                if ttft_s > maxima[2 * slot]:
                    maxima[2 * slot] = ttft_s
            if tpot_s is not None:
                ring[base + _TPOT_COUNT_AT] += 1
                ring[base + _TPOT_AT + latency_bin(tpot_s)] += 1
                if tpot_s > maxima[2 * slot + 1]:
                    maxima[2 * slot + 1] = tpot_s
        pool_ring = self._pools.rings.get(pool) or self._pools.ring(pool)
        pool_ring[slot * _POOL_WIDTH] += 1
        if good:
            pool_ring[slot * _POOL_WIDTH + 1] += 1

    def _new_maxima(self, tier: str) -> array[float]:
        # Keyed like the tier rings, so past the cap the maxima follow the ``_other`` ring.
        label = tier if tier in self._tiers.rings else OTHER_LABEL
        found = self._tier_max_s.get(label)
        if found is None:
            found = self._tier_max_s[label] = array("d", bytes(16 * self.num_slots))
        return found

    def _advance(self, index: int) -> None:
        """Make ``index`` the newest bucket: the older ones are complete and never change again."""
        self._latest_index = index
        slot = index % self.num_slots
        self._slot_index[slot] = index
        for ring in self._shapes.rings.values():
            ring[slot] = 0
        base = slot * _TIER_WIDTH
        for ring in self._tiers.rings.values():
            ring[base : base + _TIER_WIDTH] = self._zero_tier
        for maxima in self._tier_max_s.values():
            maxima[2 * slot] = maxima[2 * slot + 1] = 0.0
        base = slot * _POOL_WIDTH
        for ring in self._pools.rings.values():
            ring[base : base + _POOL_WIDTH] = self._zero_pool

    def _indices(self, now_unix_s: float, window_s: float) -> list[int]:
        """The complete buckets of the window, oldest first (the one being filled is left out)."""
        last = int(now_unix_s // self.step_s) - 1
        count = max(1, min(self.num_complete, math.ceil(window_s / self.step_s)))
        return list(range(last - count + 1, last + 1))

    def snapshot(self, now_unix_s: float, window_s: float) -> dict[str, Any]:
        """The JSON of ``GET /admin/series``: per bucket start ``t``, rates per second and p99s (null: no sample).

        Series whose every point is zero are left out.
        """
        indices = self._indices(now_unix_s, window_s)
        if indices[-1] >= self._latest_index:
            self._advance(indices[-1] + 1)  # the caller's clock says these buckets are complete
        if self._snapshot_key == (indices[-1], len(indices)):
            return self._snapshot  # shared: callers serialise it, never change it
        n, step = self.num_slots, self.step_s
        live = [(i % n) if self._slot_index[i % n] == i else -1 for i in indices]
        mix: dict[str, list[float]] = {}
        for shape, ring in sorted(self._shapes.rings.items()):
            counts = [ring[s] if s >= 0 else 0 for s in live]
            if any(counts):
                mix[shape] = [c / step for c in counts]
        tiers: dict[str, dict[str, list[Any]]] = {}
        for tier, ring in sorted(self._tiers.rings.items()):
            requests = [ring[s * _TIER_WIDTH] if s >= 0 else 0 for s in live]
            if not any(requests):
                continue
            goodput = [ring[s * _TIER_WIDTH + 1] if s >= 0 else 0 for s in live]
            p99s = [self._p99s(tier, s, i) if s >= 0 else (None, None) for s, i in zip(live, indices)]
            tiers[tier] = {
                "requests_rps": [c / step for c in requests],
                "goodput_rps": [c / step for c in goodput],
                "ttft_p99_s": [p[0] for p in p99s],
                "tpot_p99_s": [p[1] for p in p99s],
            }
        pools: dict[str, dict[str, list[float]]] = {}
        for pool, ring in sorted(self._pools.rings.items()):
            requests = [ring[s * _POOL_WIDTH] if s >= 0 else 0 for s in live]
            if any(requests):
                goodput = [ring[s * _POOL_WIDTH + 1] if s >= 0 else 0 for s in live]
                pools[pool] = {"requests_rps": [c / step for c in requests], "goodput_rps": [c / step for c in goodput]}
        self._snapshot = {"step_s": step, "t": [i * step for i in indices], "mix": mix, "tiers": tiers, "pools": pools}
        self._snapshot_key = (indices[-1], len(indices))
        return self._snapshot

    def slo_attainment(self, now_unix_s: float, window_s: float) -> dict[str, float]:
        """Per pool, the share of its requests that met their tier's objectives over the window."""
        n = self.num_slots
        live = [i % n for i in self._indices(now_unix_s, window_s) if self._slot_index[i % n] == i]
        shares: dict[str, float] = {}
        for pool, ring in self._pools.rings.items():
            requests = sum(ring[s * _POOL_WIDTH] for s in live)
            if requests:
                shares[pool] = round(sum(ring[s * _POOL_WIDTH + 1] for s in live) / requests, 4)
        return shares

    def _p99s(self, tier: str, slot: int, index: int) -> tuple[float | None, float | None]:
        cache = self._tier_p99.get(tier)
        if cache is None:
            cache = self._tier_p99[tier] = [(-1, None, None)] * self.num_slots
        cached = cache[slot]
        if cached[0] == index:
            return cached[1], cached[2]
        ring = self._tiers.rings[tier]
        base = slot * _TIER_WIDTH
        maxima = self._tier_max_s.get(tier)
        ttft = _quantile(ring, base + _TTFT_AT, ring[base + _TTFT_COUNT_AT], maxima[2 * slot] if maxima else 0.0)
        tpot = _quantile(ring, base + _TPOT_AT, ring[base + _TPOT_COUNT_AT], maxima[2 * slot + 1] if maxima else 0.0)
        cache[slot] = (index, ttft, tpot)
        return ttft, tpot

    def num_bytes(self) -> int:
        """The memory the counters hold (fixed once every label has been seen)."""
        rings = [*self._shapes.rings.values(), *self._tiers.rings.values(), *self._pools.rings.values(), *self._tier_max_s.values()]
        return sum(r.itemsize * len(r) for r in rings) + 64 * self.num_slots * (1 + len(self._tier_p99))


def _quantile(ring: array[int], start: int, total: int, max_s: float) -> float | None:
    """The p99 of the ``total`` samples in the bins at ``ring[start:]``, walked down from the maximum's bin."""
    if total == 0:
        return None
    rank = (_QUANTILE_PERCENT * total + 99) // 100  # ceil in integers: no float rounding at the edge
    above_allowed = total - rank  # samples that may lie above the p99 bin
    seen = 0
    for offset in range(latency_bin(max_s), -1, -1):
        seen += ring[start + offset]
        if seen > above_allowed:
            return max_s if offset == _NUM_BINS - 1 else min(bin_upper_s(offset), max_s)
    return max_s  # not reached: every sample lies at or below the maximum's bin
