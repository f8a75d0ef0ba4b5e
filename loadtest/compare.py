"""`polymorph loadtest compare A/ B/`: two runs side by side with B/A ratios."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from loadtest.report import read_summary

# (label, path into results.json); higher is better for the first group, lower for the latencies
_ROWS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("requests", ("requests",)),
    ("completed", ("completed",)),
    ("errors", ("errors",)),
    ("duration_s", ("duration_s",)),
    ("target_rate", ("target_rate",)),
    ("achieved_rate", ("achieved_rate",)),
    ("throughput_rps", ("throughput_rps",)),
    ("output_tokens_per_s", ("output_tokens_per_s",)),
    ("goodput_rps", ("goodput_rps",)),
    ("slo_attainment", ("slo_attainment",)),
    ("ttft_p50_s", ("ttft_s", "p50")),
    ("ttft_p90_s", ("ttft_s", "p90")),
    ("ttft_p99_s", ("ttft_s", "p99")),
    ("tpot_p50_s", ("tpot_s", "p50")),
    ("tpot_p99_s", ("tpot_s", "p99")),
    ("e2e_p99_s", ("e2e_s", "p99")),
)


def _get(summary: dict[str, Any], path: tuple[str, ...]) -> float | None:
    value: Any = summary
    for key in path:
        value = value.get(key) if isinstance(value, dict) else None
    return float(value) if isinstance(value, (int, float)) else None


def compare_rows(a: dict[str, Any], b: dict[str, Any]) -> list[tuple[str, float | None, float | None, float | None]]:
    """(metric, A, B, B/A) for the headline metrics, overall and per tier."""
    rows = []
    sections = [("", a, b)] + [
        (f"{tier}.", a["by_tier"].get(tier, {}), b["by_tier"].get(tier, {}))
        for tier in sorted(set(a.get("by_tier", {})) | set(b.get("by_tier", {})))
    ]
    for prefix, left, right in sections:
        for label, path in _ROWS:
            value_a, value_b = _get(left, path), _get(right, path)
            if prefix and value_a is None and value_b is None:
                continue
            ratio = value_b / value_a if value_a and value_b is not None else None
            rows.append((prefix + label, value_a, value_b, ratio))
    return rows


def format_table(a_name: str, b_name: str, rows: list[tuple[str, float | None, float | None, float | None]]) -> str:
    def cell(value: float | None) -> str:
        return "-" if value is None else f"{value:.4g}"

    width = max(len(name) for name, *_ in rows)
    lines = [f"{'metric':{width}s}  {'A':>12s}  {'B':>12s}  {'B/A':>8s}", f"{'':{width}s}  {a_name[-12:]:>12s}  {b_name[-12:]:>12s}"]
    lines += [f"{name:{width}s}  {cell(va):>12s}  {cell(vb):>12s}  {cell(r):>8s}" for name, va, vb, r in rows]
    return "\n".join(lines)


def main_compare(a_dir: Path, b_dir: Path) -> int:
    try:
        a, b = read_summary(a_dir), read_summary(b_dir)
    except ValueError as exc:
        print(f"error: {exc}")
        return 2
    print(format_table(str(a_dir), str(b_dir), compare_rows(a, b)))
    return 0
