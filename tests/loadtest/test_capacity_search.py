"""Capacity at SLO: the bracketing + bisection search, its per-window minimum, trace speed-up for the
simulator, one small `polymorph simulate --capacity --json` end to end, and `bench adapt` in worker processes."""

from __future__ import annotations

import json
import queue
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from gateway.cli import main
from loadtest.capacity import (
    Attainment,
    Part,
    attainment_of,
    over_draws,
    phase_bounds_s,
    pooled,
    search_capacity,
    smallest_passing,
    window_bounds_s,
)
from loadtest.simulate import in_processes, trace_source, trace_workload
from loadtest.spec import RequestSpec, Workload, make_workload
from loadtest.traces import write_native


def step_curve(capacity: float) -> Callable[[float, int], Attainment]:
    return lambda multiplier, seed: Attainment(0.99 if multiplier <= capacity else 0.5, 1000)


@pytest.mark.parametrize("true_capacity", [0.03, 0.37, 1.0, 1.7, 5.3, 40.0])
@pytest.mark.parametrize("resolution", [0.02, 0.1])
def test_bisection_finds_a_step_threshold_within_the_resolution(true_capacity: float, resolution: float) -> None:
    result = search_capacity(step_curve(true_capacity), 10.0, seed=7, resolution=resolution, max_points=40)
    assert result.note == ""
    assert result.multiplier <= true_capacity <= result.multiplier * (1 + resolution)
    assert result.rate_rps == pytest.approx(10.0 * result.multiplier)
    multipliers = [p.multiplier for p in result.curve]
    assert multipliers == sorted(multipliers) and len(set(multipliers)) == len(multipliers)
    # the curve is the one we gave: passes below the capacity, fails above
    assert all(p.passed == (p.multiplier <= true_capacity) for p in result.curve)


def test_bisection_on_a_smooth_curve_stops_at_its_threshold_crossing() -> None:
    # attainment falls linearly with load: 0.90 is reached at multiplier 2.5
    result = search_capacity(lambda m, seed: Attainment(1.0 - 0.04 * m, 500), 4.0, seed=1, threshold=0.9, resolution=0.02)
    assert result.multiplier <= 2.5 <= result.multiplier * 1.02
    assert result.rate_rps == pytest.approx(4.0 * result.multiplier)


def test_every_point_sees_the_same_seed() -> None:
    seen: list[tuple[float, int]] = []

    def attainment_at(multiplier: float, seed: int) -> Attainment:
        seen.append((multiplier, seed))
        return step_curve(3.1)(multiplier, seed)

    result = search_capacity(attainment_at, 1.0, seed=1234)
    assert len(seen) == len(result.curve) > 3
    assert {seed for _, seed in seen} == {1234}
    assert len({m for m, _ in seen}) == len(seen)  # no point run twice


def test_a_workload_failing_at_the_smallest_multiplier_has_capacity_zero() -> None:
    result = search_capacity(lambda m, seed: Attainment(0.2, 100), 30.0, seed=0, min_multiplier=1 / 8)
    assert result.multiplier == 0.0 and result.rate_rps == 0.0
    assert "capacity 0" in result.note
    assert [p.multiplier for p in result.curve] == [0.125, 0.25, 0.5, 1.0]
    assert not any(p.passed for p in result.curve)


def test_the_point_cap_bounds_the_runs_and_says_so() -> None:
    result = search_capacity(step_curve(1.37), 1.0, seed=0, resolution=0.001, max_points=5)
    assert len(result.curve) == 5
    assert "5 points" in result.note
    assert result.multiplier <= 1.37  # still a passing point


def test_passing_at_the_largest_multiplier_reports_a_lower_bound() -> None:
    result = search_capacity(step_curve(1e9), 1.0, seed=0, max_multiplier=8.0)
    assert result.multiplier == 8.0 and "at least" in result.note


def two_phase_run(second_half_miss_rate: float) -> Attainment:
    """200 requests over 600 s with a drift at 300 s: the first half all meet their SLO, the second
    half misses ``second_half_miss_rate`` of them."""
    arrivals = np.linspace(0.0, 599.0, 200)
    met = np.ones(200, dtype=bool)
    second = np.flatnonzero(arrivals >= 300.0)
    met[second[: int(round(second_half_miss_rate * second.size))]] = False
    return attainment_of(arrivals, ["standard"] * 200, met, phase_bounds_s(600.0, (300.0,)))


def test_a_good_first_half_cannot_hide_a_failing_second_half() -> None:
    run = two_phase_run(0.15)
    assert run.overall >= 0.90  # overall it would pass
    assert run.worst == pytest.approx(0.85)
    assert run.binding == "phase 300-600 s"
    # in the search: the second half's misses grow with load; overall alone would allow 2x
    result = search_capacity(lambda m, seed: two_phase_run(min(1.0, 0.1 * m)), 1.0, seed=0, resolution=0.02)
    assert 0.95 <= result.multiplier < 1.1  # 1.0 give or take one request of 100; overall alone passes to ~2
    assert all(p.attainment.overall > p.attainment.worst for p in result.curve if p.multiplier > 0.5)


def test_per_tier_minimum_and_small_slices_do_not_gate() -> None:
    tiers = ["interactive"] * 100 + ["batch"] * 100 + ["standard"] * 5
    met = np.array([True] * 100 + [True] * 80 + [False] * 20 + [False] * 5)
    run = attainment_of(np.zeros(205), tiers, met, window_bounds_s(10.0))
    assert run.worst == pytest.approx(0.80)  # batch; the 5 standard requests (0%) are too few to gate
    assert run.binding == "tier batch"
    standard = next(p for p in run.parts if p.name == "standard")
    assert standard.attainment == 0.0 and not standard.gates


def test_trace_windows_are_five_minutes() -> None:
    assert window_bounds_s(1000.0) == (0.0, 300.0, 600.0, 900.0, 1000.0)
    assert phase_bounds_s(1800.0, (600.0, 600.0, 0.0)) == (0.0, 600.0, 1800.0)


def test_draws_pool_by_requests_and_every_point_sees_the_same_seeds() -> None:
    seen: list[tuple[float, int]] = []

    def one(multiplier: float, seed: int) -> Attainment:
        seen.append((multiplier, seed))
        good = 0.99 if multiplier <= 1.3 else 0.7
        attainment = good - 0.2 if seed % 2 else good  # every other draw is 20 points worse
        return Attainment(attainment, 1000, (Part("tier", "standard", attainment, 1000, True), Part("phase", "0-60 s", attainment, 20, False)))

    result = search_capacity(over_draws(one, 3), 10.0, seed=4, resolution=0.05)
    multipliers = sorted({m for m, _ in seen})
    assert all(sorted(seed for m, seed in seen if m == multiplier) == [4, 5, 6] for multiplier in multipliers)
    point = next(p for p in result.curve if p.multiplier == 1.0)
    assert point.attainment.num_requests == 3000 and point.attainment.overall == pytest.approx((0.99 + 0.79 + 0.99) / 3)
    standard, short = point.attainment.parts
    assert standard.attainment == pytest.approx(point.attainment.overall) and standard.gates
    assert short.num_requests == 60 and not short.gates  # 20 a draw: under the one-draw bar in each
    assert point.passed and 1.0 <= result.multiplier <= 1.3  # pooled, the bad draw alone would fail (0.79)
    assert search_capacity(one, 10.0, seed=5).multiplier < 1.0  # that bad draw, judged alone
    assert pooled([point.attainment]) is point.attainment
    with pytest.raises(ValueError):
        over_draws(one, 0)


def test_simulate_capacity_draws_apply_to_scenarios_not_traces(bursty_trace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--trace", str(bursty_trace), "--format", "native", "--fleet", "H100-SXM:1", "--policy",
                 "round-robin", "--capacity", "--draws", "2", "--no-cache"]) == 2
    assert "one draw" in capsys.readouterr().err


def test_draws_without_a_capacity_search_are_refused(bursty_trace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--trace", str(bursty_trace), "--format", "native", "--fleet", "H100-SXM:1", "--policy",
                 "round-robin", "--draws", "3", "--no-cache"]) == 2
    assert "--draws judges the points of a --capacity search" in capsys.readouterr().err
    assert main(["bench", "adapt", "--scenarios", "drift-step", "--draws", "3", "--no-cache"]) == 2
    assert "--draws judges the points of --metric capacity" in capsys.readouterr().err



def test_simulate_refuses_flags_nothing_would_read(bursty_trace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Before, --stretch on a trace and the compile flags without --compile were ignored without a word."""
    trace = ["simulate", "--trace", str(bursty_trace), "--format", "native", "--fleet", "H100-SXM:1", "--policy", "round-robin", "--no-cache"]
    assert main([*trace, "--stretch", "3"]) == 2
    assert "a trace keeps its own time axis" in capsys.readouterr().err
    assert main([*trace, "--compile-trials", "5"]) == 2
    assert "--compile-trials need --compile" in capsys.readouterr().err


def test_a_scenario_with_no_positive_duration_or_stretch_is_refused_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    for flag, value in (("--duration", "-5"), ("--duration", "0"), ("--stretch", "0")):
        with pytest.raises(SystemExit) as stopped:
            main(["simulate", "--scenario", "drift-step", flag, value, "--no-cache"])
        assert stopped.value.code == 2 and f"argument {flag}: must be > 0" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["simulate", "--scenario", "stationary", "--duration", "60"],
                                     ["bench", "adapt", "--scenarios", "stationary", "--policies", "adaptive", "--no-progress"]])
def test_bad_flags_of_simulate_and_bench_adapt_are_refused_before_any_run(command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """Each of these ended in a traceback in bench adapt (a bad --model, --fleet or policy; --rate 0), was
    reported as "a workload with no rate" (--rate 0 in simulate), or was silently ignored (--gpus 0)."""
    bad = [(["--model", "nope"], "unknown model 'nope'"), (["--fleet", "nope:2"], "unknown GPU 'nope'")]
    if command[0] == "bench":
        bad.append((["--policies", "adaptive,nope"], "unknown policies ['nope']"))
    for extra, says in bad:
        assert main([*command, "--no-cache", *extra]) == 2, extra
        err = capsys.readouterr().err
        assert says in err and "Traceback" not in err, err
    for extra, says in ((["--rate", "0"], "argument --rate: must be > 0"), (["--gpus", "0"], "argument --gpus: must be an integer >= 1")):
        with pytest.raises(SystemExit) as stopped:  # refused by argparse (kernels.argtypes)
            main([*command, "--no-cache", *extra])
        assert stopped.value.code == 2 and says in capsys.readouterr().err


def test_a_decision_log_that_cannot_be_written_ends_simulate_before_the_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # before, the run went to its end, then the log said it could not write and kept the lines in memory
    assert main(["simulate", "--scenario", "drift-step", "--no-cache", "--decisions", str(tmp_path / "no-folder" / "d.jsonl")]) == 2
    assert "polymorph simulate: [Errno 2] No such file or directory" in capsys.readouterr().err


def test_smallest_passing_finds_the_fewest_gpus() -> None:
    asked: list[int] = []

    def passes(n: int) -> bool:
        asked.append(n)
        return n >= 11

    assert smallest_passing(passes, 2, 16) == 11
    assert len(asked) <= 6
    assert smallest_passing(lambda n: False, 2, 16) is None


@pytest.fixture
def bursty_trace(tmp_path: Path) -> Path:
    """Bursts of 20 requests 0.1 s apart, every 30 s, with a mix of tiers and lengths."""
    rng = np.random.default_rng(3)
    specs = []
    for burst in range(6):
        for k in range(20):
            specs.append(RequestSpec(arrival_s=30.0 * burst + 0.1 * k, input_tokens=int(rng.integers(100, 8000)),
                                     output_tokens=int(rng.integers(10, 600)), domain=("chat", "code")[k % 2],
                                     tier=("interactive", "standard", "batch")[k % 3]))
    path = tmp_path / "bursty.jsonl"
    write_native(make_workload("bursty", specs), path)
    return path


def test_trace_speedup_keeps_the_mix_and_compresses_the_gaps(bursty_trace: Path) -> None:
    original = trace_workload(str(bursty_trace), "native", None, None)
    fast = trace_workload(str(bursty_trace), "native", 4.0, None)
    assert fast.target_rate_rps == pytest.approx(4 * original.target_rate_rps)
    def mix(workload: Workload) -> list[tuple[int, int, str, str]]:
        return [(s.input_tokens, s.output_tokens, s.domain, s.tier) for s in workload.specs]

    assert mix(fast) == mix(original)  # same requests, same order
    gaps = np.diff([s.arrival_s for s in original.specs])
    fast_gaps = np.diff([s.arrival_s for s in fast.specs])
    np.testing.assert_allclose(fast_gaps, gaps / 4, atol=1e-5)  # the burst pattern, not a Poisson redraw
    assert np.std(fast_gaps) / np.mean(fast_gaps) == pytest.approx(np.std(gaps) / np.mean(gaps), rel=1e-3)


def test_trace_rate_and_multipliers_scale_the_same_requests(bursty_trace: Path) -> None:
    at_rate = trace_workload(str(bursty_trace), "native", None, 10.0)
    assert at_rate.target_rate_rps == pytest.approx(10.0)
    source = trace_source(str(bursty_trace), "native", None, 10.0)
    assert source.is_trace and source.nominal_rate_rps == pytest.approx(10.0)
    doubled = source.build(2.0, source.seed)
    assert doubled.target_rate_rps == pytest.approx(20.0)
    assert sorted(s.tier for s in doubled.specs) == sorted(s.tier for s in at_rate.specs)
    with pytest.raises(ValueError, match="not both"):
        trace_workload(str(bursty_trace), "native", 2.0, 10.0)


def test_a_trace_whose_requests_all_arrive_at_once_is_refused_with_a_reason_not_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """It spans no time: no rate to scale or multiply, and nothing for the simulator to play. Before,
    `simulate` and both capacity searches ended in ZeroDivisionError, and `--rate` was ignored."""
    burst = tmp_path / "burst.jsonl"
    burst.write_text("".join(json.dumps({"timestamp": 5.0, "input_length": 100 + i, "output_length": 20}) + "\n" for i in range(30)))
    for extra in ([], ["--capacity"], ["--rate", "5"]):
        assert main(["simulate", "--trace", str(burst), "--format", "native", "--fleet", "H100-SXM:1", "--no-cache", *extra]) == 2
        err = capsys.readouterr().err
        assert "arrive at one instant" in err and "Traceback" not in err
    assert main(["loadtest", "--target", "http://127.0.0.1:9", "--trace", str(burst), "--format", "native", "--capacity"]) == 2
    assert "arrive at one instant" in capsys.readouterr().err


def test_simulate_capacity_json_end_to_end(bursty_trace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["simulate", "--trace", str(bursty_trace), "--format", "native", "--fleet", "H100-SXM:1",
                 "--policy", "round-robin", "--capacity", "--json", "--resolution", "0.25", "--max-points", "10",
                 "--no-cache"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["workload"] == "bursty.jsonl" and out["policy"] == "round-robin" and out["fleet"] == {"H100-SXM": 1}
    assert out["threshold"] == 0.9 and out["resolution"] == 0.25
    curve = out["curve"]
    assert [p["multiplier"] for p in curve] == sorted(p["multiplier"] for p in curve)
    passing = [p["multiplier"] for p in curve if p["passed"]]
    failing = [p["multiplier"] for p in curve if not p["passed"]]
    if out["capacity_multiplier"] > 0:
        assert out["capacity_multiplier"] == max(passing)
        assert out["capacity_rps"] == pytest.approx(out["capacity_multiplier"] * out["nominal_rate_rps"], rel=1e-3)
    assert not failing or min(failing) > out["capacity_multiplier"]
    assert all(p["worst"] <= p["overall"] for p in curve)
    assert {part["kind"] for p in curve for part in p["parts"]} == {"tier", "window"}


def test_bench_adapt_capacity_on_a_trace_alone_reports_gpus_saved(bursty_trace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["bench", "adapt", "--metric", "capacity", "--scenarios", "", "--trace", str(bursty_trace), "--format", "native",
                 "--fleet", "H100-SXM:2", "--policies", "static-initial,adaptive", "--json", "--resolution", "0.5",
                 "--max-points", "3", "--no-cache", "--no-progress"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fleet_search"] is True and out["fleet"] == {"H100-SXM": 2}
    assert not {"drift-step", "stationary"} & out.keys()  # '' runs no scenario
    entry = out["bursty.jsonl"]
    assert set(entry["min_gpus"]) == {"static-initial", "adaptive"}
    found = {p: n for p, n in entry["min_gpus"].items() if n is not None}
    assert all(1 <= n <= 4 for n in found.values())  # the search stops at twice the fleet
    if len(found) == 2:
        assert entry["gpus_saved_by_adaptive"] == {"static-initial": found["static-initial"] - found["adaptive"]}
    assert set(entry["adaptive_over"]) == {"static-initial"}


def test_bench_adapt_with_no_scenario_and_no_trace_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "adapt", "--metric", "capacity", "--scenarios", "", "--json"]) == 2
    assert "nothing to run" in capsys.readouterr().err


def test_bench_adapt_capacity_in_worker_processes_gives_each_policy_the_figures_of_one_process(
        bursty_trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    policies = ("round-robin", "static-initial", "adaptive")

    def run(workers: int) -> dict[str, Any]:  # the second run's workers read the capacity answers the first one cached
        code = main(["bench", "adapt", "--metric", "capacity", "--scenarios", "", "--trace", str(bursty_trace), "--format",
                     "native", "--fleet", "H100-SXM:1", "--policies", ",".join(policies), "--json",
                     "--resolution", "0.5", "--max-points", "3", "--capacity-cache", str(tmp_path / "capacity.json"),
                     "--no-fleet-search", "--workers", str(workers)])
        assert code == 0
        captured = capsys.readouterr()
        for policy in policies:  # the progress bar names each search's points as they are judged, from a worker too
            assert re.search(rf"bursty\.jsonl {policy} x1 (pass|fail)", captured.err), (policy, captured.err[-2000:])
        entry: dict[str, Any] = json.loads(captured.out)["bursty.jsonl"]
        return entry

    alone, spread = run(1), run(2)
    assert spread["capacity_multiplier"] == alone["capacity_multiplier"]
    assert spread["capacity_rps"] == alone["capacity_rps"] and spread["adaptive_over"] == alone["adaptive_over"]
    assert len(set(alone["capacity_multiplier"].values())) > 1  # the policies differ, so a mix-up would show


def test_bench_adapt_goodput_in_worker_processes_matches_one_process(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    def run(workers: int) -> dict[str, Any]:  # the drift at 60 s: static-initial sheds what round-robin queues
        code = main(["bench", "adapt", "--scenarios", "drift-step", "--policies", "round-robin,static-initial", "--duration",
                     "120", "--stretch", "0.2", "--fleet", "H100-SXM:1,H200:1", "--rate", "8", "--capacity-cache",
                     str(tmp_path / "capacity.json"), "--workers", str(workers)])
        assert code == 0
        entry: dict[str, Any] = json.loads(capsys.readouterr().out.splitlines()[-1])["drift-step"]
        return entry

    alone, spread = run(1), run(2)
    assert spread["goodput_rps"] == alone["goodput_rps"] and spread["shed"] == alone["shed"]
    assert alone["goodput_rps"]["round-robin"] != alone["goodput_rps"]["static-initial"]


def _square_in_steps(n: int, progress: queue.Queue[str]) -> int:  # a worker's job (spawned: defined at module level)
    for step in range(3):
        progress.put(f"{n}:{step}")
    return n * n


def test_in_processes_hands_on_each_jobs_progress_before_its_result() -> None:
    events: list[str] = []
    for result in in_processes(_square_in_steps, [(1,), (2,), (3,)], 2, events.append):
        events.append(f"= {result}")
    assert [e for e in events if e.startswith("=")] == ["= 1", "= 4", "= 9"]  # results in the jobs' order
    for n in (1, 2, 3):
        mine = [events.index(f"{n}:{step}") for step in range(3)]
        assert mine == sorted(mine) and mine[-1] < events.index(f"= {n * n}")


def test_bench_adapt_refuses_no_workers(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        main(["bench", "adapt", "--workers", "0"])
    assert stopped.value.code == 2 and "argument --workers: must be an integer >= 1" in capsys.readouterr().err
