"""Capacity at SLO, live: `polymorph loadtest --capacity` against a real gateway and emulated replica,
the workload at each multiplier, the time budget, and the flags it refuses."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.cli import main
from loadtest.capacity import Attainment, search_capacity
from loadtest.live_capacity import source_from_args
from tests.conftest import REPO
from tests.support.procs import running, start_emulator, start_gateway

FIXTURES = Path(__file__).parent / "fixtures"
DEMO_KEY = "sk-polymorph-demo"
# Near-regular arrivals (Gamma, CV 0.05) of identical interactive chats: one request at a time
# fits the replica (max_running_requests 1), each holding it ~0.4 s, so it serves ~2.5 req/s.
# Below that nothing queues; above it the queue, and TTFT, grow through the run.
SCENARIO = """\
name: capacity-chat
description: identical interactive chats at near-regular arrivals, for the live capacity test
duration_s: 8
seed: 5
streams:
  - name: chat
    arrival: {process: gamma, rate_rps: 2, cv: 0.05}
    tenant: acme
    classes:
      - {name: chat, domain: chat, input: 100, output: 40, tier: interactive}
"""


def loadtest_args(**overrides: object) -> argparse.Namespace:
    values: dict[str, object] = {
        "scenario": None, "trace": None, "format": None, "duration": None, "start": 0.0, "rate": None, "speedup": None,
        "seed": None, "tenants": None, "tiers": None, "domains": None, "assign": None,
    }
    return argparse.Namespace(**{**values, **overrides})


def test_live_capacity_against_a_gateway_is_finite_and_its_curve_monotone(tmp_path: Path) -> None:
    scenario = tmp_path / "capacity-chat.yaml"
    scenario.write_text(SCENARIO)
    emulator = start_emulator(tmp_path, "replica", speed=1.0, extra=["--config", '{"max_running_requests": 1}'])
    with running(emulator):
        gateway = start_gateway(tmp_path, ["--upstream", emulator.url, "--no-access-log"])
        with running(gateway):
            completed = subprocess.run(
                [sys.executable, "-m", "gateway.cli", "loadtest", "--target", gateway.url, "--api-key", DEMO_KEY,
                 "--scenario", str(scenario), "--slo-ttft", "interactive=2", "--capacity", "--resolution", "0.5",
                 "--max-points", "5", "--max-duration-s", "150", "--drain-timeout", "20", "--json", "--no-progress",
                 "--out", str(tmp_path / "run")],
                cwd=REPO, capture_output=True, text=True, timeout=240,
            )
    assert completed.returncode == 0, completed.stderr + gateway.log()
    out = json.loads(completed.stdout)
    curve = out["curve"]
    assert out["workload"] == "capacity-chat" and out["nominal_rate_rps"] == pytest.approx(2.0)
    assert 0 < out["capacity_multiplier"] < max(p["multiplier"] for p in curve), out  # finite: some point failed
    assert out["capacity_multiplier"] == max(p["multiplier"] for p in curve if p["passed"])
    # monotone: every passing point lies below every failing one, and attainment falls from the lightest to the heaviest load
    passing = [p["multiplier"] for p in curve if p["passed"]]
    failing = [p["multiplier"] for p in curve if not p["passed"]]
    assert max(passing) < min(failing)
    assert curve[0]["worst"] > curve[-1]["worst"]
    assert out["wall_s"] <= 150 and len(curve) <= 5
    assert {part["kind"] for p in curve for part in p["parts"]} == {"tier", "phase"}
    # each point's records beside the curve, as a plain run writes them
    saved = json.loads((tmp_path / "run" / "capacity.json").read_text())
    assert saved["curve"] == curve
    for point in curve:
        results = json.loads((tmp_path / "run" / f"x{point['multiplier']:.4g}" / "results.json").read_text())
        assert results["requests"] == point["num_requests"]


def test_every_point_of_a_scenario_is_generated_with_the_same_seed() -> None:
    source = source_from_args(loadtest_args(scenario=str(FIXTURES / "short-drift.yaml")))
    assert source.seed == 9 and not source.is_trace
    again = source_from_args(loadtest_args(scenario=str(FIXTURES / "short-drift.yaml")))
    for multiplier in (0.5, 1.0, 2.0):
        assert source.build(multiplier, source.seed) == again.build(multiplier, again.seed)
    doubled = source.build(2.0, source.seed)
    assert doubled.duration_s == source.build(1.0, source.seed).duration_s  # phases stay put
    assert doubled.drift_onsets_s == source.build(1.0, source.seed).drift_onsets_s
    assert doubled.num_requests > 1.5 * source.build(1.0, source.seed).num_requests


def test_a_trace_point_replays_the_same_requests_faster() -> None:
    source = source_from_args(loadtest_args(trace=str(FIXTURES / "native_small.jsonl"), format="native", tiers="interactive=1,batch=1"))
    base, fast = source.build(1.0, source.seed), source.build(4.0, source.seed)
    assert source.is_trace and source.nominal_rate_rps == pytest.approx(base.target_rate_rps)
    assert [(s.input_tokens, s.output_tokens, s.tier) for s in fast.specs] == [(s.input_tokens, s.output_tokens, s.tier) for s in base.specs]
    assert [s.arrival_s for s in fast.specs] == pytest.approx([s.arrival_s / 4 for s in base.specs])


def test_the_time_budget_stops_the_search_with_the_bracket_so_far() -> None:
    ran: list[float] = []

    def attainment_at(multiplier: float, seed: int) -> Attainment:
        ran.append(multiplier)
        return Attainment(0.99 if multiplier <= 1.3 else 0.5, 1000)

    result = search_capacity(attainment_at, 1.0, seed=0, can_run=lambda multiplier: len(ran) < 4)
    assert len(ran) == 4 and len(result.curve) == 4
    assert "time budget after 4 points" in result.note and "capacity between" in result.note
    assert result.multiplier <= 1.3


@pytest.mark.parametrize(("flags", "message"), [
    (["--concurrency", "4"], "runs open loop"),
    (["--max-duration-s", "5"], "leaves no time for one point"),
    (["--slo-threshold", "0"], "--slo-threshold must be in (0, 1]"),
])
def test_capacity_refuses_flags_it_cannot_honour(flags: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["loadtest", "--target", "http://127.0.0.1:9", "--scenario", str(FIXTURES / "short-drift.yaml"), "--capacity",
                 "--drain-timeout", "10", *flags])
    assert code == 2
    assert message in capsys.readouterr().err
