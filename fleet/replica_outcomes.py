"""Sense, per replica: each finished request's outcome on the replica that answered it, for canary trials.

``fleet.telemetry`` keeps the mix per shape and pool; a canary (fleet.canary) compares one replica with
its siblings of the same pool over the same window, so it needs figures per replica. The gateway
records every finished request here (O(1): one tuple on a bounded deque); ``figures`` sums a
replica's records over ``[since, until)`` on the caller's clock.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any

MAX_RECORDS_PER_REPLICA = 8192  # bounds memory; a trial window that holds more reads the newest


@dataclass(frozen=True, slots=True)
class ReplicaFigures:
    """One replica's finished requests over a window. ``s_per_token`` is the answers' time (first token,
    then every further one) summed over the completion tokens they produced: queueing in the engine, a
    slower prefill or decode all raise it, and longer answers do not."""

    slot: str
    num_requests: int
    num_failed: int
    num_met_slo: int
    num_tokens: int
    s_per_token: float | None  # None: no successful request produced a token
    # the coefficient of variation of each successful request's own seconds per token (its sampling noise:
    # the relative standard error of s_per_token is about cv / sqrt(num_requests)); None with fewer than two
    cv: float | None
    ttft_mean_s: float | None
    tpot_mean_s: float | None

    @property
    def failed_share(self) -> float:
        return self.num_failed / self.num_requests if self.num_requests else 0.0

    @property
    def slo_share(self) -> float:
        return self.num_met_slo / self.num_requests if self.num_requests else 1.0

    def to_json(self) -> dict[str, Any]:
        return {"num_requests": self.num_requests, "num_failed": self.num_failed, "num_met_slo": self.num_met_slo,
                "num_tokens": self.num_tokens, "s_per_token": _round(self.s_per_token), "cv": _round(self.cv), "ttft_mean_s": _round(self.ttft_mean_s),
                "tpot_mean_s": _round(self.tpot_mean_s)}


def pooled(slot: str, figures: tuple[ReplicaFigures, ...]) -> ReplicaFigures:
    """Several replicas' figures as one (request- and token-weighted; no ``cv``), named ``slot``."""
    num_tokens = sum(f.num_tokens for f in figures)
    busy_s = sum(f.s_per_token * f.num_tokens for f in figures if f.s_per_token is not None)
    return ReplicaFigures(slot, sum(f.num_requests for f in figures), sum(f.num_failed for f in figures),
                          sum(f.num_met_slo for f in figures), num_tokens, busy_s / num_tokens if num_tokens else None, None,
                          _weighted(figures, "ttft_mean_s"), _weighted(figures, "tpot_mean_s"))


class ReplicaOutcomes:
    def __init__(self, max_per_replica: int = MAX_RECORDS_PER_REPLICA) -> None:
        self.max_per_replica = max_per_replica
        # replica -> (at, ok, met_slo, answer_s, completion_tokens, ttft_s, tpot_s)
        self._records: dict[str, deque[tuple[float, bool, bool, float | None, int, float | None, float | None]]] = {}

    def record(self, now: float, replica: str, ok: bool, met_slo: bool, ttft_s: float | None, tpot_s: float | None,
               completion_tokens: int) -> None:
        """A request ``replica`` answered ended at ``now``. A non-streamed answer's ``ttft_s`` is its whole time."""
        found = self._records.get(replica)
        if found is None:
            found = self._records[replica] = deque(maxlen=self.max_per_replica)
        answer_s = None if ttft_s is None else ttft_s + (tpot_s or 0.0) * max(0, completion_tokens - 1)
        found.append((now, ok, met_slo, answer_s, completion_tokens, ttft_s, tpot_s))

    def figures(self, replica: str, since: float, until: float) -> ReplicaFigures:
        num = failed = met = tokens = 0
        busy_s, ttfts, tpots, per_token = 0.0, [], [], []
        for at, ok, met_slo, answer_s, num_tokens, ttft_s, tpot_s in self._records.get(replica, ()):
            if not since <= at < until:
                continue
            num += 1
            met += met_slo
            if not ok:
                failed += 1
                continue
            if answer_s is not None and num_tokens > 0:
                busy_s += answer_s
                tokens += num_tokens
                per_token.append(answer_s / num_tokens)
            if ttft_s is not None:
                ttfts.append(ttft_s)
            if tpot_s is not None:
                tpots.append(tpot_s)
        return ReplicaFigures(replica, num, failed, met, tokens, busy_s / tokens if tokens else None, _cv(per_token),
                              sum(ttfts) / len(ttfts) if ttfts else None, sum(tpots) / len(tpots) if tpots else None)


def _weighted(figures: tuple[ReplicaFigures, ...], name: str) -> float | None:
    pairs = [(getattr(f, name), f.num_requests - f.num_failed) for f in figures if getattr(f, name) is not None]
    weight = sum(n for _, n in pairs)
    return sum(v * n for v, n in pairs) / weight if weight else None


def _cv(values: list[float]) -> float | None:
    if len(values) < 2:
        return None
    mean = sum(values) / len(values)
    variance = sum((v - mean) ** 2 for v in values) / (len(values) - 1)
    return math.sqrt(variance) / mean if mean > 0 else None


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 6)
