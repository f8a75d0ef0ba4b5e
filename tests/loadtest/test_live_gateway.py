"""A real run through the Polymorph gateway in front of an emulated replica (all real subprocesses)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from loadtest.plots import PLOT_FILES
from tests.conftest import REPO
from tests.support.procs import running, start_emulator, start_gateway

FIXTURES = Path(__file__).parent / "fixtures"
DEMO_KEY = "sk-polymorph-demo"
DEMO_ADMIN_TOKEN = "polymorph-admin-demo"


def test_loadtest_through_gateway_and_emulator_writes_files_and_plots(tmp_path: Path) -> None:
    emulator = start_emulator(tmp_path, "replica", speed=10.0)
    with running(emulator):
        gateway = start_gateway(tmp_path, ["--upstream", emulator.url, "--no-access-log"])
        with running(gateway):
            out = tmp_path / "run"
            completed = subprocess.run(
                [sys.executable, "-m", "gateway.cli", "loadtest", "--target", gateway.url, "--api-key", DEMO_KEY,
                 "--admin-token", DEMO_ADMIN_TOKEN, "--scenario", str(FIXTURES / "short-drift.yaml"),
                 "--out", str(out), "--no-progress"],
                cwd=REPO, capture_output=True, text=True, timeout=120,
            )
    assert completed.returncode == 0, completed.stderr + gateway.log()
    results = json.loads((out / "results.json").read_text())
    assert results["errors"] == 0 and results["completed"] == results["requests"] > 20
    assert results["ttft_s"]["p99"] is not None and results["tpot_s"]["p99"] is not None
    assert set(results["by_tier"]) == {"interactive", "standard", "batch"}
    records = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    assert all(record["pool"] and record["replica"] and record["shape"] for record in records)
    assert all(record["input_tokens"] == record["target_input_tokens"] for record in records)
    assert all(record["output_tokens"] == record["target_output_tokens"] for record in records)
    for name in PLOT_FILES:
        assert (out / name).stat().st_size > 10_000
