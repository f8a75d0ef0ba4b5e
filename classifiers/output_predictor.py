"""Predicted output tokens (p50, p90) that learn online from finished responses.

Each (tenant, domain) key, and each domain across tenants, keeps a log-binned histogram of the
``usage.completion_tokens`` it saw, with exponential decay so it tracks drift and its memory is a
fixed list whatever the traffic. Both halves of the hot path are O(1) pure Python: ``observe`` adds
one growing increment to one bin (decay applied lazily, renormalised rarely), and ``predict``
recomputes a key's quantiles only once the responses it has not reflected yet carry a set share of
the key's weight. A key with few observations blends towards the domain-wide sketch, then towards
a per-domain prior; ``max_tokens`` caps both quantiles.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from dataclasses import dataclass, field
from itertools import accumulate

# Bins are powers of GAMMA: a quantile is off by at most ~GAMMA/2 relative (4%), up to MAX_TOKENS.
GAMMA = 1.08
MAX_TOKENS = 1 << 17
NUM_BINS = int(math.log(MAX_TOKENS) / math.log(GAMMA)) + 2
_BIN_UPPER = tuple(GAMMA**index for index in range(NUM_BINS))
_LOG_GAMMA = math.log(GAMMA)

# Rough per-domain priors (p50, p90) for a chat model answering with no max_tokens pressure;
# used only until a key has history, and pulled towards it after a handful of responses.
DOMAIN_PRIORS: dict[str, tuple[int, int]] = {
    "code": (320, 900),
    "math": (260, 650),
    "summarization": (140, 350),
    "extraction": (90, 300),
    "classification": (8, 60),
    "creative_writing": (420, 950),
    "brainstorming": (350, 800),
    "qa": (90, 400),
    "chat": (160, 500),
}
_FALLBACK_PRIOR = (200, 600)
PRIOR_WEIGHT = 8.0  # observations that weigh as much as the prior
DEFAULT_MAX_HISTORY_PER_KEY = 512
DEFAULT_MAX_KEYS = 10_000


# Quantiles are recomputed once the responses not yet reflected carry this share of a sketch's
# weight: every response while a key is young, every ~weight/32 responses at steady state. The
# staleness this allows moves p50 by at most one bin and p90 by two (tested), within the sampling
# error of a 512-response memory.
STALE_WEIGHT_SHARE = 1.0 / 32
# Lazy decay grows the increment by 1/decay per response; rescale before floats lose range.
_MAX_INCREMENT = 1e64


@dataclass(slots=True)
class QuantileSketch:
    """Exponentially decayed log histogram: effective memory ``1 / (1 - decay)`` observations.

    Decay is lazy: instead of multiplying every bin by ``decay`` per response, each response adds
    an increment that grows by ``1 / decay``, so the ratios between bins are the decayed ones. The
    bins are rescaled when the increment grows large (every ~75k responses at the default memory).
    """

    growth: float  # 1 / decay
    counts: list[float] = field(default_factory=lambda: [0.0] * NUM_BINS)
    increment: float = 1.0  # weight of the next response, in the bins' current unit
    total: float = 0.0  # sum of counts
    stale: float = 0.0  # weight added since the quantiles were last computed
    p50: float = 0.0
    p90: float = 0.0

    @classmethod
    def empty(cls, max_history: int) -> QuantileSketch:
        decay = 1.0 - 1.0 / max(1, max_history)
        return cls(1.0 / decay if decay > 0.0 else math.inf)  # inf: keep only the last response

    @property
    def weight(self) -> float:
        """Decayed number of responses seen (the latest weighs 1)."""
        return self.total / self.increment if self.total else 0.0

    def add(self, value: int) -> None:
        index = min(NUM_BINS - 1, max(0, math.ceil(math.log(max(1, value)) / _LOG_GAMMA)))
        if self.total:
            self.increment *= self.growth
            if self.increment > _MAX_INCREMENT:
                self._rescale()
        self.counts[index] += self.increment
        self.total += self.increment
        self.stale += self.increment

    def _rescale(self) -> None:
        scale = 1.0 / self.increment  # 0.0 when growth is inf: the past is forgotten
        self.counts = [count * scale for count in self.counts]
        self.total *= scale
        self.stale *= scale
        self.increment = 1.0

    def refresh(self) -> None:
        """Recompute p50/p90 if enough weight arrived since they were computed (cheap no-op otherwise)."""
        if self.stale <= STALE_WEIGHT_SHARE * self.total and self.p50:
            return
        cumulative = list(accumulate(self.counts))
        total = cumulative[-1]
        self.p50 = _BIN_UPPER[min(NUM_BINS - 1, bisect_left(cumulative, 0.5 * total))]
        self.p90 = _BIN_UPPER[min(NUM_BINS - 1, bisect_left(cumulative, 0.9 * total))]
        self.stale = 0.0


class OutputPredictor:
    """Per (tenant, domain) output-length quantiles with bounded memory (LRU over keys)."""

    __slots__ = ("_max_history", "_max_keys", "_sketches")

    def __init__(self, max_history_per_key: int = DEFAULT_MAX_HISTORY_PER_KEY, max_keys: int = DEFAULT_MAX_KEYS):
        if max_history_per_key < 1 or max_keys < 1:
            raise ValueError("max_history_per_key and max_keys must be >= 1")
        self._sketches: dict[tuple[str, str], QuantileSketch] = {}
        self._max_history = max_history_per_key
        self._max_keys = max_keys

    @property
    def num_keys(self) -> int:
        return len(self._sketches)

    def predict(self, tenant: str, domain: str, prompt_tokens: int, max_tokens: int | None) -> tuple[int, int]:
        """(p50, p90) completion tokens for a request; never above ``max_tokens``."""
        prior_p50, prior_p90 = DOMAIN_PRIORS.get(domain, _FALLBACK_PRIOR)
        p50, p90 = float(prior_p50), float(prior_p90)
        if domain in ("summarization", "extraction"):
            # outputs of these grow with the input, sublinearly
            scale = min(4.0, max(0.5, math.sqrt(prompt_tokens / 1000.0)))
            p50, p90 = p50 * scale, p90 * scale
        for key in (("*", domain), (tenant, domain)):
            sketch = self._sketches.get(key)
            if sketch is not None:
                sketch.refresh()
                trust = sketch.weight / (sketch.weight + PRIOR_WEIGHT)
                p50 += trust * (sketch.p50 - p50)
                p90 += trust * (sketch.p90 - p90)
        if max_tokens is not None and max_tokens > 0:
            p50, p90 = min(p50, max_tokens), min(p90, max_tokens)
        p50_int = max(1, round(p50))
        return p50_int, max(p50_int, round(p90))

    def observe(self, tenant: str, domain: str, completion_tokens: int) -> None:
        """Learn from one finished response's ``usage.completion_tokens``."""
        if completion_tokens < 0:
            return
        for key in (("*", domain), (tenant, domain)):
            sketch = self._sketches.pop(key, None)  # re-insert: dict order is the LRU order
            if sketch is None:
                sketch = QuantileSketch.empty(self._max_history)
                if len(self._sketches) >= self._max_keys:
                    del self._sketches[next(iter(self._sketches))]
            sketch.add(completion_tokens)
            self._sketches[key] = sketch
