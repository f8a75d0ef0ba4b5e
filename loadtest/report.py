"""Writing and reading a run's output folder: results.json, requests.jsonl, plots."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import orjson

from loadtest.record import RequestRecord, record_from_json

RESULTS_FILE = "results.json"
REQUESTS_FILE = "requests.jsonl"


def write_results(out_dir: Path, summary: dict[str, Any], records: tuple[RequestRecord, ...]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / RESULTS_FILE).write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    with (out_dir / REQUESTS_FILE).open("wb") as handle:
        for record in records:
            handle.write(orjson.dumps(record.to_json()) + b"\n")


def read_summary(run_dir: Path) -> dict[str, Any]:
    path = run_dir / RESULTS_FILE
    try:
        return dict(json.loads(path.read_text(encoding="utf-8")))
    except OSError as exc:
        raise ValueError(f"{run_dir} is not a loadtest output folder: cannot read {path} ({exc.strerror})") from None
    except ValueError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None


def read_records(run_dir: Path) -> list[RequestRecord]:
    with (run_dir / REQUESTS_FILE).open("rb") as handle:
        return [record_from_json(orjson.loads(line)) for line in handle if line.strip()]


def text_summary(summary: dict[str, Any]) -> str:
    """A few human lines for the end of a run."""

    def ms(stat: dict[str, Any], key: str) -> str:
        value = stat.get(key)
        return "-" if value is None else f"{value * 1000:.0f} ms"

    lines = [
        f"{summary['workload']}: {summary['requests']} requests, {summary['completed']} completed, "
        f"{summary['errors']} errors in {summary['duration_s']:.1f} s ({summary['mode']})",
        f"goodput {summary['goodput_rps']:.2f} req/s, SLO attainment {summary['slo_attainment']:.1%}, "
        f"throughput {summary['throughput_rps']:.2f} req/s, {summary['output_tokens_per_s']:.0f} output tok/s",
        f"TTFT p50 {ms(summary['ttft_s'], 'p50')} p99 {ms(summary['ttft_s'], 'p99')}; "
        f"TPOT p50 {ms(summary['tpot_s'], 'p50')} p99 {ms(summary['tpot_s'], 'p99')}",
    ]
    for tier, group in summary["by_tier"].items():
        lines.append(f"  {tier:12s} {group['requests']:6d} req  goodput {group['goodput_rps']:.2f}/s  "
                     f"attainment {group['slo_attainment']:.1%}  TTFT p99 {ms(group['ttft_s'], 'p99')}")
    lag = summary["scheduling_error_ms"]
    if summary.get("target_rate") is not None and lag["p99"] is not None:
        lines.append(f"generator: target {summary['target_rate']:.1f} req/s, achieved {summary['achieved_rate']:.1f}, "
                     f"scheduling error p50 {lag['p50']:.2f} ms p99 {lag['p99']:.2f} ms")
    if summary["generator_note"]:
        lines.append(f"WARNING: {summary['generator_note']}")
    return "\n".join(lines)
