"""Length distributions as the planner needs them: quarter-octave histograms and equal-mass points.

A shape's capacity depends on its whole length distribution, not its mean: a few 16k-token prompts
set the p99 TTFT of a pool whose mean prompt is 6k. Telemetry and the simulator's policies count
lengths in quarter-octave bins (2^(k/4) tokens, a 19% step) and summarise a histogram as
``NUM_POINTS`` equally weighted points, each the mean of one equal-mass slice of the distribution
(so the points keep the mean, and the last point carries the tail). The capacity model replays the
cross product of the prompt and output points (lengths treated as independent), and snapping keeps
nearby windows on the same cache entry.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

NUM_POINTS = 4
BINS_PER_OCTAVE = 4


def length_bin(tokens: int) -> int:
    """Quarter-octave bin of a token count (1 token and below share bin 0)."""
    return round(BINS_PER_OCTAVE * math.log2(tokens)) if tokens > 1 else 0


def bin_tokens(index: int) -> int:
    return max(1, round(2 ** (index / BINS_PER_OCTAVE)))


def snap_tokens(tokens: float) -> int:
    """Round to the quarter-octave grid, at least 1."""
    return bin_tokens(length_bin(max(1, round(tokens)))) if tokens > 1 else 1


def add_counts(into: dict[int, int], more: Mapping[int, int]) -> None:
    for index, n in more.items():
        into[index] = into.get(index, 0) + n


def histogram(tokens: Iterable[int]) -> dict[int, int]:
    counts: dict[int, int] = {}
    for value in tokens:
        index = length_bin(value)
        counts[index] = counts.get(index, 0) + 1
    return counts


def equal_mass_points(bin_to_count: Mapping[int, int], num_points: int = NUM_POINTS) -> tuple[int, ...]:
    """``num_points`` lengths, each the mean of one equal-mass slice of the histogram, snapped to the
    grid; () for an empty histogram."""
    total = sum(bin_to_count.values())
    if total <= 0:
        return ()
    slice_mass = total / num_points
    sums = [0.0] * num_points
    filled, k = 0.0, 0
    for index in sorted(bin_to_count):
        value, left = float(bin_tokens(index)), float(bin_to_count[index])
        while left > 1e-9 and k < num_points:
            take = min(left, slice_mass - filled)
            sums[k] += take * value
            filled += take
            left -= take
            if filled >= slice_mass - 1e-9:
                k, filled = k + 1, 0.0
    return tuple(snap_tokens(s / slice_mass) for s in sums)
