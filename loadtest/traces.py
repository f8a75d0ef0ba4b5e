"""Trace replay: a trace file (kernels.traces reads Azure, BurstGPT, Mooncake and native) as a ``Workload``.

Arrivals start at 0; rows that carry no domain, tenant or tier get the defaults. Rows that cannot be
used are skipped and reported as ``RowIssue(line, reason)``; a file that is not the named format at all
raises ``TraceFormatError``. Pure: file reading only.
"""

from __future__ import annotations

import json
from pathlib import Path

from kernels.traces import FORMATS, TraceFormatError, TraceRow, read_trace_rows, sniff_format
from loadtest.spec import DEFAULT_DOMAIN, DEFAULT_TENANT, DEFAULT_TIER, RequestSpec, Workload, make_workload

__all__ = ["FORMATS", "TraceFormatError", "read_trace", "sniff_format", "write_native"]


def read_trace(path: Path | str, trace_format: str, domain: str = DEFAULT_DOMAIN) -> Workload:
    """Read ``path`` as ``trace_format`` (one of FORMATS); ``domain`` labels rows that carry none."""
    trace = read_trace_rows(path, trace_format)
    start_s = min(row.arrival_s for row in trace.rows)
    specs = [_spec(row, start_s, domain, trace.label) for row in trace.rows]
    return make_workload(trace.label, specs, issues=trace.issues)


def _spec(row: TraceRow, start_s: float, domain: str, label: str) -> RequestSpec:
    return RequestSpec(
        arrival_s=row.arrival_s - start_s,
        input_tokens=row.input_tokens,
        output_tokens=row.output_tokens,
        domain=row.domain or domain,
        tenant=row.tenant or DEFAULT_TENANT,
        tier=row.tier or DEFAULT_TIER,
        hash_ids=row.hash_ids,
        text=row.text,
        label=row.label or label,
    )


def write_native(workload: Workload, path: Path | str) -> None:
    """Write ``workload`` as native JSONL (the inverse of ``read_trace(path, "native")``)."""
    with Path(path).open("w", encoding="utf-8") as handle:
        for spec in workload.specs:
            row: dict[str, object] = {
                "timestamp": round(spec.arrival_s, 6),
                "input_length": spec.input_tokens,
                "output_length": spec.output_tokens,
                "domain": spec.domain,
                "tenant": spec.tenant,
                "tier": spec.tier,
            }
            if spec.hash_ids:
                row["hash_ids"] = list(spec.hash_ids)
            if spec.text is not None:
                row["text"] = spec.text
            handle.write(json.dumps(row) + "\n")
