"""`polymorph loadtest` end to end in-process: files, plots, compare, and the error exits."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.cli import main
from loadtest.fast_backend import fast_backend_process
from loadtest.plots import PLOT_FILES
from tests.conftest import free_port

FIXTURES = Path(__file__).parent / "fixtures"
REQUIRED_KEYS = {"requests", "completed", "errors", "duration_s", "target_rate", "achieved_rate", "goodput_rps",
                 "slo_attainment", "ttft_s", "tpot_s", "by_tier"}


@pytest.fixture(scope="module")
def backend() -> Iterator[str]:
    with fast_backend_process(None, "--routing-headers") as url:
        yield url


def test_scenario_run_writes_results_requests_and_plots(backend: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["loadtest", "--target", backend, "--scenario", str(FIXTURES / "short-drift.yaml"),
                 "--out", str(tmp_path), "--no-progress", "--slo-ttft", "interactive=0.5"])
    assert code == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert set(results) >= REQUIRED_KEYS
    assert results["errors"] == 0 and results["completed"] == results["requests"] > 20
    assert {"p50", "p90", "p99"} <= set(results["ttft_s"]) and {"p50", "p90", "p99"} <= set(results["tpot_s"])
    assert set(results["by_tier"]) == {"interactive", "standard", "batch"}
    assert results["slo"]["interactive"] == {"ttft_s": 0.5, "tpot_s": 0.05}
    assert results["drift_onsets_s"] == [2.0]
    lines = (tmp_path / "requests.jsonl").read_text().splitlines()
    assert len(lines) == results["requests"]
    assert json.loads(lines[0])["pool"] == "fast-pool"
    for name in PLOT_FILES:
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "goodput" in capsys.readouterr().out


def test_trace_replay_with_speedup_window_and_assignment(backend: str, tmp_path: Path) -> None:
    code = main(["loadtest", "--target", backend, "--trace", str(FIXTURES / "mooncake_small.jsonl"), "--format",
                 "mooncake", "--speedup", "2", "--tiers", "batch", "--tenants", "acme=1", "--no-plots",
                 "--no-stream", "--out", str(tmp_path)])  # with the live progress line
    assert code == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["requests"] == 4 and set(results["by_tier"]) == {"batch"} and set(results["by_tenant"]) == {"acme"}
    scheduled = [json.loads(line)["scheduled_at_s"] for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
    assert scheduled == [0.0, 0.125, 0.125, 1.25]


def test_compare_prints_side_by_side_ratios(backend: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for name, rate in (("a", "10"), ("b", "20")):
        assert main(["loadtest", "--target", backend, "--scenario", str(FIXTURES / "short-drift.yaml"), "--rate", rate,
                     "--duration", "2", "--no-plots", "--no-progress", "--out", str(tmp_path / name)]) == 0
    capsys.readouterr()
    assert main(["loadtest", "compare", str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    table = capsys.readouterr().out
    requests_row = next(line for line in table.splitlines() if line.startswith("requests "))
    a_count, b_count, ratio = (float(cell) for cell in requests_row.split()[1:4])
    assert ratio == pytest.approx(b_count / a_count, rel=1e-3) and 1.2 < ratio < 4
    assert any(line.startswith("interactive.goodput_rps") for line in table.splitlines())


def test_unreachable_target_exits_non_zero_with_a_message(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["loadtest", "--target", f"http://127.0.0.1:{free_port()}", "--scenario", "stationary",
                 "--duration", "1", "--out", str(tmp_path), "--no-progress"])
    assert code == 3
    assert "cannot reach the target" in capsys.readouterr().err
    assert not (tmp_path / "results.json").exists()


def test_wrong_trace_format_exits_with_the_format_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["loadtest", "--target", "http://127.0.0.1:1", "--trace", str(FIXTURES / "azure_small.csv"),
                 "--format", "mooncake", "--out", str(tmp_path)])
    assert code == 2
    assert "--format azure" in capsys.readouterr().err


def test_dry_run_writes_the_workload_without_a_target(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["loadtest", "--scenario", "flash-crowd", "--duration", "30", "--rate", "5", "--dry-run",
                 "--out", str(tmp_path)]) == 0
    rows = [json.loads(line) for line in (tmp_path / "workload.jsonl").read_text().splitlines()]
    assert 100 < len(rows) < 200 and {"timestamp", "input_length", "output_length", "tenant", "tier"} <= set(rows[0])


def test_a_dry_run_without_out_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["loadtest", "--scenario", "flash-crowd", "--duration", "5", "--dry-run"]) == 2
    assert "--out DIR is required" in capsys.readouterr().err


def test_compare_of_a_missing_run_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["loadtest", "compare", str(tmp_path / "x"), str(tmp_path / "y")]) == 2
    assert "not a loadtest output folder" in capsys.readouterr().out


def test_dry_run_applies_rules_domains_and_fractions(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rules = tmp_path / "rules.yaml"
    rules.write_text("- {set: tier, to: batch, min_input_tokens: 800}\n- {set: tenant, to: coder, domains: [code]}\n")
    assert main(["loadtest", "--trace", str(FIXTURES / "azure_small.csv"), "--format", "azure", "--domains", "code",
                 "--assign", str(rules), "--dry-run", "--out", str(tmp_path)]) == 0
    rows = [json.loads(line) for line in (tmp_path / "workload.jsonl").read_text().splitlines()]
    assert [row["tier"] for row in rows] == ["standard", "standard", "batch", "standard"]
    assert {row["tenant"] for row in rows} == {"coder"} and {row["domain"] for row in rows} == {"code"}
    rules.write_text("- {set: tier, to: batch}\n- {set: tier, to: batch, colour: red}\n")
    assert main(["loadtest", "--trace", str(FIXTURES / "azure_small.csv"), "--format", "azure",
                 "--assign", str(rules), "--dry-run", "--out", str(tmp_path)]) == 2
    assert f"{rules}:2: [1].colour: unknown field" in capsys.readouterr().err  # the file and the line of the rule
    for rule, says in (("{set: tier, to: batch, min_input_tokens: abc}", "[0].min_input_tokens: must be an integer"),
                       ("{set: tenant, to: coder, domains: code}", "[0].domains: must be a list of strings"),
                       ("{set: tier, to: [batch]}", "[0].to: must be a string"),
                       ("{set: colour, to: red}", "[0].set: cannot assign 'colour'"),
                       # an unknown domain was sent chat prompts under its own label
                       ("{set: domain, to: coding}", "[0].to: unknown domain 'coding'"),
                       ("{set: tier, to: batch, domains: [coding]}", "[0].domains[0]: 'coding' is not one of")):
        rules.write_text(f"- {rule}\n")  # a traceback, a silent {c, o, d, e}, a silent '[batch]', and no line before
        assert main(["loadtest", "--trace", str(FIXTURES / "azure_small.csv"), "--format", "azure",
                     "--assign", str(rules), "--dry-run", "--out", str(tmp_path)]) == 2
        assert f"{rules}:1: {says}" in capsys.readouterr().err
    for flag, value, says in (("--domains", "code=1,coding=1", "--domains: unknown domain 'coding'"),
                              ("--tenants", "acme=0.7,acme=0.3", "'acme' is given twice")):
        assert main(["loadtest", "--trace", str(FIXTURES / "azure_small.csv"), "--format", "azure", flag, value,
                     "--dry-run", "--out", str(tmp_path)]) == 2
        assert says in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["loadtest", "--scenario", "stationary", "--rate", "1e12", "--dry-run", "--out", "OUT"],
                                  ["simulate", "--scenario", "stationary", "--rate", "1e12"],
                                  ["simulate", "--scenario", "stationary", "--rate", "1e12", "--capacity"],
                                  ["bench", "loadgen", "--rates", "100,1e12", "--duration", "1"]])
def test_a_rate_no_schedule_can_hold_is_refused_before_the_run(argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(tmp_path) if arg == "OUT" else arg for arg in argv]) == 2
    assert "a schedule holds at most 10,000,000" in capsys.readouterr().err


# just past the bound, so that a run the check no longer refused would be slow, not a MemoryError (`--stretch 1e9`)
@pytest.mark.parametrize("argv", [["simulate", "--scenario", "drift-step", "--stretch", "4400"],
                                  ["simulate", "--scenario", "drift-step", "--duration", "2.6e6", "--rate", "0.001", "--capacity"],
                                  ["simulate", "--trace", str(FIXTURES / "azure_small.csv"), "--format", "azure", "--speedup", "3e-6"]])
def test_a_simulated_run_longer_than_30_days_is_refused_before_it_starts(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2  # before, every controller tick was queued at the start: `--stretch 1e9` ended in a MemoryError
    assert "a simulated run spans at most 2,592,000 s (30 days)" in capsys.readouterr().err


_TRACE = ["--trace", "TRACE", "--format", "azure"]


@pytest.mark.parametrize("argv", [["loadtest", *_TRACE, "--dry-run", "--out", "OUT"],
                                  ["simulate", *_TRACE, "--policy", "static-initial", "--json"],
                                  ["simulate", *_TRACE, "--policy", "static-initial", "--capacity", "--max-points", "2", "--json"],
                                  ["bench", "adapt", "--metric", "capacity", "--scenarios", "", *_TRACE, "--policies", "static-initial,adaptive",
                                   "--max-points", "2", "--no-fleet-search", "--workers", "2", "--json"],
                                  ["compile", *_TRACE, "--model", "llama-3.1-8b", "--gpu", "H100-SXM", "--evaluator", "analytic", "--json"]])
def test_every_command_that_reads_a_trace_says_once_which_rows_it_skipped(argv: list[str], tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """Before, only `polymorph loadtest` said so: simulate, bench adapt and compile dropped them silently (bench
    adapt's workers read the trace again, and must not say it again)."""
    trace = FIXTURES / "azure_small.csv"
    assert main([{"TRACE": str(trace), "OUT": str(tmp_path)}.get(arg, arg) for arg in argv]) == 0
    err = capfd.readouterr().err
    assert f"warning: {trace}: skipped 3 bad rows:\n  line 5: " in err and "  line 7: " in err and err.count("skipped") == 1
