"""Summarise a request trace as a TrafficShape (and replayable requests) for `polymorph compile --trace`.

kernels may not import loadtest, so this reads only what a shape needs from the same four formats
loadtest.traces reads (azure, burstgpt, mooncake, native): arrival, prompt and output lengths,
domain and prefix hash ids. Bad rows are skipped; a file with no usable row raises ValueError."""

from __future__ import annotations

import csv
import io
import json
from datetime import datetime
from pathlib import Path

from kernels.compiler.evaluators import ReplayRequest
from kernels.compiler.shape import TIER_SLOS, TrafficShape, shape_from_samples

TRACE_FORMATS = ("azure", "burstgpt", "mooncake", "native")
_CSV_COLUMNS = {"azure": ("TIMESTAMP", "ContextTokens", "GeneratedTokens"),
                "burstgpt": ("Timestamp", "Request tokens", "Response tokens")}
_MAX_REQUESTS = 4000  # a replay longer than this costs more than it tells


def read_trace_requests(path: Path | str, trace_format: str) -> list[ReplayRequest]:
    if trace_format not in TRACE_FORMATS:
        raise ValueError(f"unknown trace format {trace_format!r}; choose one of {', '.join(TRACE_FORMATS)}")
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read trace {path}: {exc}") from None
    rows = _csv_rows(text, trace_format) if trace_format in _CSV_COLUMNS else _jsonl_rows(text, trace_format)
    if not rows:
        raise ValueError(f"{path}: no usable {trace_format} rows")
    start = min(r.arrival_s for r in rows)
    shifted = [ReplayRequest(r.arrival_s - start, r.prompt_tokens, r.output_tokens, r.domain, r.prefix_hash_ids) for r in rows]
    return sorted(shifted, key=lambda r: r.arrival_s)[:_MAX_REQUESTS]


def _csv_rows(text: str, trace_format: str) -> list[ReplayRequest]:
    when, prompt, output = _CSV_COLUMNS[trace_format]
    rows: list[ReplayRequest] = []
    for row in csv.DictReader(io.StringIO(text)):
        try:
            at = float(row[when]) if trace_format == "burstgpt" else _azure_time(row[when])
            rows.append(ReplayRequest(at, int(float(row[prompt])), int(float(row[output]))))
        except (KeyError, TypeError, ValueError):
            continue
    return [r for r in rows if r.prompt_tokens > 0 and r.output_tokens > 0]


def _azure_time(value: str) -> float:
    # Azure writes 7 fractional digits; datetime takes at most 6.
    head, _, frac = value.strip().partition(".")
    return datetime.fromisoformat(head).timestamp() + (float("0." + frac) if frac else 0.0)


def _jsonl_rows(text: str, trace_format: str) -> list[ReplayRequest]:
    scale = 1e-3 if trace_format == "mooncake" else 1.0  # Mooncake timestamps are milliseconds
    rows: list[ReplayRequest] = []
    for line in text.splitlines():
        try:
            obj = json.loads(line)
            rows.append(ReplayRequest(float(obj["timestamp"]) * scale, int(obj["input_length"]), int(obj["output_length"]),
                                      str(obj.get("domain", "chat")), tuple(int(h) for h in obj.get("hash_ids") or ())))
        except (ValueError, TypeError, KeyError, AttributeError):
            continue
    return [r for r in rows if r.prompt_tokens > 0 and r.output_tokens > 0]


def prefix_share(requests: list[ReplayRequest]) -> float:
    """Fraction of prompt blocks whose hash id an earlier request already had (what a prefix cache reuses)."""
    seen: set[int] = set()
    total = reused = 0
    for req in requests:
        total += len(req.prefix_hash_ids)
        reused += sum(1 for h in req.prefix_hash_ids if h in seen)
        seen.update(req.prefix_hash_ids)
    return min(0.95, reused / total) if total else 0.0


def shape_from_trace(path: Path | str, trace_format: str, tier: str = "interactive") -> tuple[TrafficShape, list[ReplayRequest]]:
    if tier not in TIER_SLOS:
        raise ValueError(f"unknown tier {tier!r}; choose one of {', '.join(TIER_SLOS)}")
    requests = read_trace_requests(path, trace_format)
    duration = requests[-1].arrival_s - requests[0].arrival_s
    shape = shape_from_samples(
        Path(path).stem, [r.prompt_tokens for r in requests], [r.output_tokens for r in requests],
        [r.domain for r in requests], prefix_share(requests), duration if duration > 0 else None, tier,
    )
    return shape, requests
