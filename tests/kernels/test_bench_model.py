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


def test_bad_calibration_files_and_values_are_said_not_tracebacks(shared_dir: Path, tmp_path: Path) -> None:
    """Before: a KeyError for other columns, a UnicodeDecodeError, a ValueError or ZeroDivisionError for one bad
    value, bare NaN in the JSON line, and `kernels fit` fitting no rows (NaN errors over the shipped parameters)."""
    polymorph = str(REPO / ".venv" / "bin" / "polymorph")
    with (shared_dir / "calibration" / "calibration.csv").open(newline="") as handle:
        reader = csv.DictReader(handle)
        header, rows = list(reader.fieldnames or ()), list(reader)
    bad_values = tmp_path / "bad-values.csv"
    with bad_values.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, header)
        writer.writeheader()
        writer.writerows([{**row, "value": value} for row, value in zip(rows[:40], ("abc", "0") * 20, strict=False)])
    done = subprocess.run([polymorph, "bench", "model", "--data", str(bad_values)], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert "is not a positive finite measurement" in done.stdout and json.loads(done.stdout.strip().splitlines()[-1])["rows_scored"] == 0
    (tmp_path / "columns.csv").write_text("a,b\n1,2\n")
    (tmp_path / "binary.csv").write_bytes(b"\xff\xfe" + bytes(range(256)))
    (tmp_path / "header.csv").write_text(",".join(header) + "\n")
    for name, says in (("columns.csv", "is not a calibration CSV: it lacks the columns id"), ("binary.csv", "is not UTF-8 text"),
                       ("header.csv", "no row of"), ("bad-values.csv", "no row of")):
        done = subprocess.run([polymorph, "kernels", "fit", "--dry-run", "--data", str(tmp_path / name)],
                              capture_output=True, text=True, timeout=120, check=False)
        assert done.returncode != 0 and says in done.stderr and "Traceback" not in done.stderr, (name, done.stderr)
