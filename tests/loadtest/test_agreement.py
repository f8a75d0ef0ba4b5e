"""`polymorph bench agreement`: the live config is the simulator's starting fleet, the decision log counts
as the controller's counters do, and a tiny run produces both sides and the JSON line.

The figures (live vs simulator within 15%) come from the bench itself (fleet/README.md); here the run is a
few seconds of traffic, too short for the controller to act, so no ratio is asserted.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from fleet.rollout import SlotState
from gateway.cli import main
from gateway.config import load_config
from loadtest.agreement import decision_counts, live_config, starting_pools
from loadtest.demo import DEMO_CONFIG
from tests.conftest import REPO

SHORT_DRIFT = REPO / "tests" / "loadtest" / "fixtures" / "short-drift.yaml"
CHAT = '{"chunked_prefill_size": 2048, "tp": 1}'
LONG = '{"chunked_prefill_size": 8192, "tp": 1}'


def test_the_live_config_deploys_the_simulators_starting_partition(tmp_path: Path) -> None:
    slots = [SlotState("H100-SXM/0", "short-chat@H100-SXM", "H100-SXM", CHAT), SlotState("H200/0", "long-context@H200", "H200", LONG),
             SlotState("H100-SXM/1", "short-chat@H100-SXM", "H100-SXM", CHAT)]
    pools = starting_pools(slots, "llama-3.1-8b")
    config = live_config(yaml.safe_load(DEMO_CONFIG.read_text()), pools, 5.0, 18080, tmp_path, None)
    path = tmp_path / "live.yaml"
    path.write_text(yaml.safe_dump(config))
    loaded = load_config(path)  # the gateway accepts it: pools named as the controller names its own
    assert [(p.name, p.gpu, p.num_launched, dict(p.engine)) for p in loaded.pools] == [
        ("long-context@H200", "H200", 1, json.loads(LONG)), ("short-chat@H100-SXM", "H100-SXM", 2, json.loads(CHAT))]
    assert loaded.pools[1].shapes == ("short-chat",)
    assert loaded.emulator_speed == 5.0 and loaded.controller.enabled and loaded.controller.capacity_cache is None
    assert loaded.server.port == 18080 and loaded.tiers == load_config(DEMO_CONFIG).tiers


def test_decisions_count_like_the_controllers_counters() -> None:
    entries = [
        {"at_unix_s": 1.0, "kind": "plan", "evidence": {"outcome": "keep", "diff": {}}},
        {"at_unix_s": 2.0, "kind": "plan", "evidence": {"outcome": "apply", "diff": {"a@H200": [2, 1], "b@H200": [0, 1]}}},
        {"at_unix_s": 2.0, "kind": "recompile", "evidence": {"reason": "lengths changed",
                                                             "moves": [["H200/0", "a@H200", "a@H200"], ["H200/1", "a@H200", "a@H200"]]}},
        {"at_unix_s": 3.0, "kind": "plan", "evidence": {"outcome": "apply", "diff": {}}},  # recompiles only: not a repartition
        {"at_unix_s": 3.0, "kind": "step", "evidence": {"moves": [["H200/1", "a@H200", "b@H200"]]}},
    ]
    assert decision_counts(entries) == (1, 2)
    assert decision_counts([]) == (0, 0)


def test_a_tiny_run_reports_both_sides_and_one_json_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["bench", "agreement", "--scenario", str(SHORT_DRIFT), "--fleet", "H100-SXM:1,H200:1", "--rate", "12",
                 "--speed", "2", "--out", str(tmp_path), "--no-progress"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    summary = json.loads(printed.strip().splitlines()[-1])
    assert summary["bench"] == "agreement" and summary["fleet"] == {"H100-SXM": 1, "H200": 1} and summary["speed"] == 2.0
    sim, live = summary["simulator"], summary["live"]
    for side in (sim, live):
        assert set(side) >= {"goodput_rps", "slo_attainment", "requests", "shed", "failed", "repartitions", "recompiles", "wall_s"}
    assert sim["requests"] == live["requests"] > 20  # the same seeded requests on both sides
    assert live["failed"] == 0 and live["goodput_rps"] > 0 and sim["goodput_rps"] > 0
    assert summary["goodput_ratio_live_over_sim"] == pytest.approx(live["goodput_rps"] / sim["goodput_rps"], abs=1e-3)
    assert "simulator" in printed and "live" in printed
    assert (tmp_path / "live-config.yaml").exists() and (tmp_path / "gateway.log").exists()
