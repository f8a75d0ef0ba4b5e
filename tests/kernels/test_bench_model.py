"""`polymorph bench model --json` end to end: a real subprocess scoring the shared calibration CSV."""

from __future__ import annotations

import csv
import json
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_bench_model_json_last_line(shared_dir: Path) -> None:
    data = shared_dir / "calibration" / "calibration.csv"
    done = subprocess.run([str(REPO / ".venv" / "bin" / "polymorph"), "bench", "model", "--json", "--data", str(data)],
                          capture_output=True, text=True, timeout=120, check=True)
    lines = done.stdout.strip().splitlines()
    summary = json.loads(lines[-1])
    assert set(summary) == {"rows_scored", "rows_skipped", "median_ape_pct"}
    assert set(summary["median_ape_pct"]) == {"throughput", "tpot", "ttft"}
    with data.open(newline="") as handle:
        num_rows = sum(1 for _ in csv.DictReader(handle))
    assert summary["rows_scored"] + summary["rows_skipped"] == num_rows
    assert summary["median_ape_pct"]["throughput"] < 30 and summary["median_ape_pct"]["tpot"] < 30
    per_row = [json.loads(line) for line in lines if line.startswith('{"id"')]
    assert len(per_row) == summary["rows_scored"]
    assert "skipped" in done.stdout
