"""Telemetry across processes: a gateway aggregates what it saw, an out-of-process controller replays it.

A gateway that is not the controller's process records arrivals and outcomes into a ``TelemetryBatch``
(the same two calls as ``ModelTelemetry``, so the request path does not care which it has). The batch
keeps counts and token sums per (telemetry bucket, model, shape, tier or pool, length bin): a report is a
few hundred numbers whatever the request rate. An outcome row's last two numbers, the prompt tokens
engines served from a prefix cache and the prompt tokens those were counted among, are optional: a
gateway of an earlier version sends rows without them. ``replay`` feeds a report into the controller's
``ModelTelemetry`` at each bucket's time, each length bin's tokens spread over its requests, so each
model's controller sees windows, rates and length histograms of its own requests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fleet.lengths import length_bin
from fleet.multi import ModelTelemetry

_MAX_PER_ENTRY = 1_000_000  # a report claiming more requests per bucket and bin than this is not a gateway's


class TelemetryBatch:
    """A gateway's arrivals and outcomes since its last report, per model (the served one)."""

    def __init__(self, bucket_s: float = 5.0) -> None:
        self.bucket_s = bucket_s
        self._arrivals: dict[tuple[int, str, str, str, int], list[int]] = {}  # -> [num, prompt tokens]
        # -> [num, completion tokens, cached prompt tokens, the prompt tokens they were counted among]
        self._outcomes: dict[tuple[int, str, str, str, bool, int], list[int]] = {}

    def record_arrival(self, now: float, shape: str, tier: str, prompt_tokens: int, model: str) -> None:
        key = (int(now // self.bucket_s), model, shape, tier, length_bin(prompt_tokens))
        entry = self._arrivals.setdefault(key, [0, 0])
        entry[0] += 1
        entry[1] += prompt_tokens

    def record_outcome(self, now: float, shape: str, pool: str, met_slo: bool, completion_tokens: int, model: str,
                       cached_tokens: int = 0, of_prompt_tokens: int = 0) -> None:
        key = (int(now // self.bucket_s), model, shape, pool, met_slo, length_bin(completion_tokens))
        entry = self._outcomes.setdefault(key, [0, 0, 0, 0])
        entry[0] += 1
        entry[1] += completion_tokens
        entry[2] += cached_tokens
        entry[3] += of_prompt_tokens

    def take(self) -> dict[str, Any]:
        """The report so far (JSON-able), and a fresh batch."""
        doc = {
            "bucket_s": self.bucket_s,
            "arrivals": [[b, model, shape, tier, n, tokens] for (b, model, shape, tier, _), (n, tokens) in self._arrivals.items()],
            "outcomes": [[b, model, shape, pool, met, n, tokens, cached, cached_of]
                         for (b, model, shape, pool, met, _), (n, tokens, cached, cached_of) in self._outcomes.items()],
        }
        self._arrivals, self._outcomes = {}, {}
        return doc


def _spread(num: int, tokens: int) -> list[int]:
    """``num`` token counts that add up to ``tokens`` (the bin's requests, each near the bin's mean)."""
    q, r = divmod(tokens, num)
    return [q + 1] * r + [q] * (num - r)


def _entries(doc: dict[str, Any], key: str, width: int, num_at: int) -> list[list[Any]]:
    """``doc[key]``'s rows, each ``width`` long with its count at ``num_at`` and token sums after it."""
    rows = doc.get(key, [])
    if not isinstance(rows, list) or not all(isinstance(row, list) and len(row) == width for row in rows):
        raise ValueError(f"{key} must be a list of {width}-element lists")
    for row in rows:
        num, tokens = row[num_at], row[num_at + 1:]
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (row[0], num, *tokens)):
            raise ValueError(f"{key}: bucket, count and tokens must be integers")
        if not (1 <= num <= _MAX_PER_ENTRY and min(tokens) >= 0):
            raise ValueError(f"{key}: count must be 1..{_MAX_PER_ENTRY} and tokens >= 0")
        if not all(isinstance(v, str) for v in row[1:4]):
            raise ValueError(f"{key}: model, shape and tier/pool must be strings")
    return rows


@dataclass(frozen=True, slots=True)
class Report:
    """A validated report: rows of ``take()``'s lists."""

    bucket_s: float
    arrivals: tuple[tuple[int, str, str, str, int, int], ...]  # bucket, model, shape, tier, count, prompt tokens
    # bucket, model, shape, pool, met SLO, count, completion tokens, cached prompt tokens, the prompt tokens they were counted among
    outcomes: tuple[tuple[int, str, str, str, bool, int, int, int, int], ...]


def parse(doc: object) -> Report:
    """Check a report a gateway sent; raises ValueError (TypeError) on anything ``take()`` does not produce."""
    if not isinstance(doc, dict):
        raise TypeError("the telemetry report must be a JSON object")
    bucket_s = doc.get("bucket_s")
    if isinstance(bucket_s, bool) or not isinstance(bucket_s, (int, float)) or bucket_s <= 0:
        raise ValueError("bucket_s must be a positive number")
    rows = doc.get("outcomes", [])
    if isinstance(rows, list):  # an earlier version's rows end at the completion tokens: no cache figures
        doc = {**doc, "outcomes": [[*row, 0, 0] if isinstance(row, list) and len(row) == 7 else row for row in rows]}
    outcomes = _entries(doc, "outcomes", 9, 5)
    if not all(isinstance(row[4], bool) for row in outcomes):
        raise ValueError("outcomes: met_slo must be true or false")
    return Report(float(bucket_s), tuple(tuple(r) for r in _entries(doc, "arrivals", 6, 4)), tuple(tuple(r) for r in outcomes))


def replay(report: Report, telemetry: ModelTelemetry, now: float) -> None:
    """Record a gateway's report into ``telemetry`` (a model no controller plans is dropped there), each
    bucket at its middle (never ahead of ``now``)."""

    def at(bucket: int) -> float:
        return min((bucket + 0.5) * report.bucket_s, now)

    # oldest first: Telemetry counts a record older than its newest bucket into the newest one
    rows = sorted([(row[0], 0, row) for row in report.arrivals] + [(row[0], 1, row) for row in report.outcomes], key=lambda r: (r[0], r[1]))
    for bucket, _, row in rows:
        if len(row) == 6:  # an arrival (sorted before the bucket's outcomes)
            _, model, shape, tier, num, tokens = row
            for prompt_tokens in _spread(num, tokens):
                telemetry.record_arrival(at(bucket), shape, tier, prompt_tokens, model)
        else:
            _, model, shape, pool, met, num, tokens, cached, cached_of = row
            for completion_tokens, cached_tokens, of_prompt in zip(_spread(num, tokens), _spread(num, cached), _spread(num, cached_of), strict=True):
                telemetry.record_outcome(at(bucket), shape, pool, met, completion_tokens, model, cached_tokens, of_prompt)
