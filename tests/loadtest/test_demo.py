"""`polymorph demo`: the scenario in fleet time, the decision lines, and the command against a real gateway.

The run with the controller on, a drift and the dashboard in a browser is
tests/gateway/test_dashboard_browser.py; here the gateway fronts one emulated replica without a controller.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from gateway.cli import main
from kernels.tiers import DEFAULT_TIERS, TierSlo
from loadtest.demo import DEMO_CONFIG, DEMO_SCENARIO, decision_summary, decisions_since, demo_workload, describe_decision, fleet_time_slos
from loadtest.plots import PLOT_FILES
from loadtest.scenario import build_workload, load_scenario
from tests.conftest import REPO, free_port
from tests.support.procs import running, start_emulator, start_gateway

SHORT_DRIFT = REPO / "tests" / "loadtest" / "fixtures" / "short-drift.yaml"
MIX_AFTER = {"shapes": {"long-context": {"rate_rps": 1.5}, "short-chat": {"rate_rps": 0.5}}, "window_s": 120.0}
DECISIONS = [
    {"at_unix_s": 90.0, "kind": "drift", "evidence": {"reason": "rate change", "score": None, "divergence": 0.0, "rate_change": None,
                                                      "dwell_since": 60.0, "mix_before": {"shapes": {}}, "mix_after": {"shapes": {}}}},
    {"at_unix_s": 1000.0, "kind": "drift", "evidence": {"reason": "mix divergence", "score": 2.1, "divergence": 0.4, "rate_change": 0.1,
                                                        "dwell_since": 970.0, "mix_before": {"shapes": {}}, "mix_after": MIX_AFTER}},
    {"at_unix_s": 1000.0, "kind": "plan", "evidence": {"outcome": "apply", "diff": {"long-context@H200": [0, 2], "short-chat@H200": [2, 0]},
                                                        "predicted_goodput_before_rps": 0.8, "predicted_goodput_after_rps": 2.9}},
    {"at_unix_s": 1000.0, "kind": "step", "evidence": {"moves": [["long-h200-0", "short-chat@H200", "long-context@H200", "{}"]]}},
    {"at_unix_s": 1004.5, "kind": "verify", "evidence": {"ok": True, "observed_goodput_rps": 2.7, "predicted_goodput_rps": 2.9}},
    {"at_unix_s": 1009.0, "kind": "rollback", "evidence": {"moves": [["long-h200-1", "x", "x", "{}"]], "reason": "observed goodput below prediction"}},
]


def test_the_demo_config_is_the_example_config_ten_times_faster() -> None:
    example = yaml.safe_load((REPO / "config.example.yaml").read_text())
    demo = yaml.safe_load(DEMO_CONFIG.read_text())
    assert demo["fleet"].pop("emulator_speed") == 10.0 and demo.pop("tenants_dir") == "../tenants"
    example["fleet"].pop("emulator_speed")
    example.pop("tenants_dir")
    assert demo == example  # keep examples/demo.yaml in step with config.example.yaml


def test_the_scenario_is_replayed_speed_times_faster_with_the_same_requests() -> None:
    fleet = build_workload(load_scenario(DEMO_SCENARIO))
    wall = demo_workload(str(DEMO_SCENARIO), 10.0, None, None, None)
    assert wall.num_requests == fleet.num_requests > 1000
    assert wall.duration_s == pytest.approx(fleet.duration_s / 10) and wall.drift_onsets_s == (60.0,)
    assert [s.arrival_s for s in wall.specs[:50]] == pytest.approx([s.arrival_s / 10 for s in fleet.specs[:50]])
    assert [s.input_tokens for s in wall.specs] == [s.input_tokens for s in fleet.specs]
    shorter = demo_workload(str(DEMO_SCENARIO), 10.0, 300.0, 6.0, 1)  # fleet seconds and fleet req/s
    assert shorter.duration_s == pytest.approx(30.0) and 60 * 0.8 < shorter.target_rate_rps < 60 * 1.2


def test_objectives_are_held_on_the_wall_clock_of_the_fleet() -> None:
    objectives = {"interactive": {"ttft_p99_s": 1.0, "tpot_p99_s": 0.05}, "batch": {"ttft_p99_s": 60.0, "tpot_p99_s": 0.5}}
    assert fleet_time_slos(objectives, 10.0) == {"interactive": TierSlo(0.1, 0.005), "batch": TierSlo(6.0, 0.05)}
    assert fleet_time_slos({}, 2.0)["standard"] == replace(DEFAULT_TIERS["standard"], ttft_p99_s=1.5, tpot_p99_s=0.05)


def test_each_decision_reads_as_one_line_and_the_summary_counts_them() -> None:
    lines = [describe_decision(d) for d in DECISIONS]
    assert lines[0] == "drift detected (rate change); mix now empty"
    assert lines[1] == "drift detected (mix divergence); mix now long-context 75%, short-chat 25%"
    assert lines[2] == "plan apply: long-context@H200 0->2, short-chat@H200 2->0; predicted goodput 0.8 -> 2.9 req/s"
    assert lines[3] == "step: long-h200-0 short-chat@H200 -> long-context@H200"
    assert lines[4] == "verify: observed goodput 2.7 vs predicted 2.9 req/s: kept"
    assert lines[5] == "rollback: long-h200-1 recompiled in x (observed goodput below prediction)"
    during = decisions_since(DECISIONS, 999.0)  # the log also holds an earlier run's decision
    summary = decision_summary(during, 999.0, 10.0)
    assert summary[0] == "the controller took 5 decisions: 1 drift, 1 plan, 1 step, 1 verify, 1 rollback"
    assert summary[1] == "  +   1.0 s (fleet +   10 s)  " + lines[1]
    assert summary[4].startswith("  +   5.5 s (fleet +   55 s)  verify")
    assert "took no decision" in decision_summary([], 0.0, 1.0)[0]


def test_demo_needs_a_gateway_and_its_admin_token_then_replays_and_writes_plots(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    nothing = f"http://127.0.0.1:{free_port()}"
    assert main(["demo", "--url", nothing, "--no-progress", "--out", str(tmp_path / "none")]) == 3
    assert "nothing answers at" in capsys.readouterr().err

    emulator = start_emulator(tmp_path, "replica", speed=2.0)
    with running(emulator):
        gateway = start_gateway(tmp_path, ["--upstream", emulator.url, "--no-access-log"])
        with running(gateway):
            assert main(["demo", "--url", gateway.url, "--admin-token", "not-the-token", "--no-progress"]) == 2
            assert "--admin-token" in capsys.readouterr().err
            out = tmp_path / "demo"
            code = main(["demo", "--url", gateway.url, "--scenario", str(SHORT_DRIFT), "--no-progress", "--out", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert f"dashboard: {gateway.url}/dashboard" in printed
    assert "emulated GPUs at 2x real time" in printed  # read from the replica, and the 4 s scenario played in 2 s
    assert "took no decision" in printed  # `serve --upstream` runs no controller
    results = json.loads((out / "results.json").read_text())
    assert results["errors"] == 0 and results["requests"] > 20
    assert results["duration_s"] < 4.0 and results["slo"]["interactive"] == {"ttft_s": 0.5, "tpot_s": 0.025}
    assert all((out / name).stat().st_size > 10_000 for name in PLOT_FILES)
