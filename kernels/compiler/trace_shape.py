"""Summarise a request trace as a TrafficShape (and replayable requests) for `polymorph compile --trace`.

The trace is read by kernels.traces (the reader the load generator replays with too): arrival, prompt
and output lengths, domain and prefix hash ids. Bad rows are skipped; a file with no usable row (or
not of the named format) raises ValueError."""

from __future__ import annotations

from pathlib import Path

from kernels.compiler.evaluators import ReplayRequest
from kernels.compiler.shape import TrafficShape, shape_from_samples
from kernels.config import MAX_PREFIX_SHARE
from kernels.tiers import DEFAULT_TIERS
from kernels.traces import read_trace_rows, report_skipped_rows

_MAX_REQUESTS = 4000  # a replay longer than this costs more than it tells


def read_trace_requests(path: Path | str, trace_format: str) -> list[ReplayRequest]:
    """The trace's requests, the first arriving at 0, in arrival order (at most _MAX_REQUESTS)."""
    trace = read_trace_rows(path, trace_format)  # TraceFormatError is a ValueError
    report_skipped_rows(path, trace.issues)
    rows = trace.rows
    start = min(r.arrival_s for r in rows)
    shifted = [ReplayRequest(r.arrival_s - start, r.input_tokens, r.output_tokens, r.domain or "chat", r.hash_ids) for r in rows]
    return sorted(shifted, key=lambda r: r.arrival_s)[:_MAX_REQUESTS]


def prefix_share(requests: list[ReplayRequest]) -> float:
    """Fraction of prompt blocks whose hash id an earlier request already had (what a prefix cache reuses)."""
    seen: set[int] = set()
    total = reused = 0
    for req in requests:
        total += len(req.prefix_hash_ids)
        reused += sum(1 for h in req.prefix_hash_ids if h in seen)
        seen.update(req.prefix_hash_ids)
    return min(MAX_PREFIX_SHARE, reused / total) if total else 0.0


def shape_from_trace(path: Path | str, trace_format: str, tier: str = "interactive") -> tuple[TrafficShape, list[ReplayRequest]]:
    if tier not in DEFAULT_TIERS:
        raise ValueError(f"unknown tier {tier!r}; choose one of {', '.join(DEFAULT_TIERS)}")
    requests = read_trace_requests(path, trace_format)
    duration = requests[-1].arrival_s - requests[0].arrival_s
    shape = shape_from_samples(
        Path(path).stem, [r.prompt_tokens for r in requests], [r.output_tokens for r in requests],
        [r.domain for r in requests], prefix_share(requests), duration if duration > 0 else None, tier,
    )
    return shape, requests
