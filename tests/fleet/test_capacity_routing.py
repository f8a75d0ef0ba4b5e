"""Length-distribution capacity, tier shedding and the per-pool priority queue; fleet never imports loadtest."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest

from classifiers.shape import Shape
from fleet.capacity import PerfCapacity
from fleet.health import CircuitBreaker
from fleet.lengths import equal_mass_points, histogram, snap_tokens
from fleet.pool import PoolState, ReplicaState
from fleet.queueing import PoolQueue
from fleet.router import Reject, Route, RouterSettings, route
from fleet.telemetry import ShapeLoad, Telemetry
from kernels.config import EngineConfig
from kernels.tiers import DEFAULT_TIERS

BATCH = Shape("short-chat", "chat", 0.9, 100, 50, 120, "batch", "demo", 0, None, False)


def test_equal_mass_points_keep_the_tail() -> None:
    tokens = [1000] * 90 + [16000] * 10
    points = equal_mass_points(histogram(tokens))
    assert points[:3] == (snap_tokens(1000),) * 3
    assert points[3] == snap_tokens((15 * 1000 + 10 * 16000) / 25)  # the last slice carries the tail
    assert equal_mass_points({}) == ()


def test_telemetry_window_carries_length_points() -> None:
    tel = Telemetry(window_s=20.0, bucket_s=5.0)
    for k in range(40):
        tel.record_arrival(k * 0.5, "long", "standard", 16000 if k % 10 == 0 else 2000)
        tel.record_outcome(k * 0.5, "long", "p", True, 300)
    (load,) = tel.window(20.0).shapes
    assert load.prompt_points[-1] > 2 * load.prompt_points[0] and set(load.output_points) == {snap_tokens(300)}


def test_heavy_tail_lowers_capacity_below_the_mean_estimate() -> None:
    capacity = PerfCapacity("llama-3.1-8b", num_requests=200, rel_tol=0.1)
    slo = DEFAULT_TIERS["standard"]
    mean_only = ShapeLoad("long", 1.0, 5000.0, 300.0, (("standard", 1.0),))
    tailed = replace(mean_only, prompt_points=(2048, 2896, 4096, 11585), output_points=(300,))
    assert capacity.estimate("H100-SXM", EngineConfig(), tailed, slo).rate_rps < capacity.estimate("H100-SXM", EngineConfig(), mean_only, slo).rate_rps
    assert capacity.num_evaluations == 2
    capacity.estimate("H100-SXM", EngineConfig(), tailed, slo)
    assert capacity.num_evaluations == 2  # cached


def test_a_cache_that_is_not_one_is_made_anew_and_a_folder_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Before, one bad write (a list, a number, half a file) failed every later run with a traceback."""
    slo, load = DEFAULT_TIERS["standard"], ShapeLoad("chat", 1.0, 1000.0, 200.0, (("standard", 1.0),))
    cache = tmp_path / "capacity.json"
    for text in ("[1]", '{"x": 1}', "{half", '{"k": [1, "a"]}'):
        cache.write_text(text)
        capacity = PerfCapacity("llama-3.1-8b", cache_path=cache, num_requests=100, rel_tol=0.2)
        assert "is not a capacity cache" in capsys.readouterr().err
        found = capacity.estimate("H100-SXM", EngineConfig(), load, slo)
        again = PerfCapacity("llama-3.1-8b", cache_path=cache, num_requests=100, rel_tol=0.2)  # written anew, and read
        assert again.estimate("H100-SXM", EngineConfig(), load, slo) == found and again.num_evaluations == 0
    with pytest.raises(ValueError, match="is a directory"):
        PerfCapacity("llama-3.1-8b", cache_path=tmp_path)


def test_prefetch_evaluates_side_by_side_and_matches_the_one_at_a_time_estimate() -> None:
    slo = DEFAULT_TIERS["standard"]
    loads = [ShapeLoad(name, 1.0, float(prompt), 200.0, (("standard", 1.0),)) for name, prompt in (("a", 1000), ("b", 4000))]
    queries = [("H100-SXM", config, load, slo) for load in loads for config in (EngineConfig(), EngineConfig(chunked_prefill_size=2048))]
    with ThreadPoolExecutor(max_workers=2) as executor:
        parallel = PerfCapacity("llama-3.1-8b", num_requests=100, rel_tol=0.2, executor=executor)
        parallel.prefetch(queries)
        assert parallel.num_evaluations == 4
        found = [parallel.estimate(*q) for q in queries]
        assert parallel.num_evaluations == 4  # every estimate came from the prefetch
    serial = PerfCapacity("llama-3.1-8b", num_requests=100, rel_tol=0.2)
    serial.prefetch(queries)  # without an executor: nothing happens until asked
    assert serial.num_evaluations == 0
    assert found == [serial.estimate(*q) for q in queries]


def _pool(in_flight: int, max_running: int = 4) -> PoolState:
    pool = PoolState("chat", frozenset({"m"}), frozenset({"short-chat"}), "H100-SXM", max_running)
    pool.replicas.append(ReplicaState("r0", "http://r/0", "chat", CircuitBreaker(2, 5.0), num_in_flight=in_flight))
    return pool


def test_batch_is_shed_with_retry_after_before_interactive_is_refused() -> None:
    settings = RouterSettings()
    full = _pool(in_flight=4)
    shed = route(BATCH, "m", [full], 0.0, settings, tiers=DEFAULT_TIERS)
    assert isinstance(shed, Reject) and shed.status == 429 and shed.retry_after_s == settings.shed_retry_after_s
    assert isinstance(route(replace(BATCH, tier="interactive"), "m", [full], 0.0, settings, tiers=DEFAULT_TIERS), Route)
    assert isinstance(route(BATCH, "m", [_pool(in_flight=3)], 0.0, settings, tiers=DEFAULT_TIERS), Route)
    assert isinstance(route(BATCH, "m", [full], 0.0, settings), Route)  # no tiers given: the old behaviour


def test_pool_queue_serves_by_priority_and_sheds_the_least_urgent() -> None:
    queue: PoolQueue[str] = PoolQueue(max_len=2, retry_after_s=3.0)
    assert queue.offer("batch", 2, 60.0) is None and queue.offer("std", 1, 3.0) is None
    shed = queue.offer("inter", 0, 1.0)
    assert shed is not None and shed.item == "batch" and shed.retry_after_s == 3.0  # batch makes room
    late = queue.offer("batch2", 2, 60.0)
    assert late is not None and late.item == "batch2" and len(queue) == 2  # a full queue refuses the least urgent
    assert queue.take(0.5) == ("inter", [])
    item, expired = queue.take(4.0)  # std's TTFT deadline (3 s) has passed: shed, not served
    assert item is None and [s.item for s in expired] == ["std"] and expired[0].reason == "deadline passed"


def test_fleet_never_imports_loadtest() -> None:
    root = Path(__file__).resolve().parents[2] / "fleet"
    offenders = [str(p) for p in root.rglob("*.py") if re.search(r"^\s*(from|import) loadtest", p.read_text(), re.MULTILINE)]
    assert offenders == []


def test_stretched_workload_moves_the_drift_onset_and_keeps_the_rate() -> None:
    from loadtest.scenario import load_scenario
    from loadtest.simulate import parse_fleet, stretched_workload

    workload = stretched_workload(load_scenario("drift-step"), 1200.0, 5.0, 2.0, None)
    assert workload.drift_onsets_s == (600.0,) and workload.duration_s == 1200.0
    assert abs(workload.target_rate_rps - 5.0) < 0.5
    assert parse_fleet("H100-SXM:4,H200:4") == {"H100-SXM": 4, "H200": 4}
    assert parse_fleet("H100:2,H100-SXM:3,h200:1") == {"H100-SXM": 5, "H200": 1}  # an alias is its kind


def test_fill_budget_deploys_every_gpu_and_prefers_undoing_a_shrink() -> None:
    from fleet.planner import PlanProblem, PoolOption, fill_budget, plan

    pools = (PoolOption.one("a@G", "G", "a", 1, 100.0, 1.0), PoolOption.one("b@G", "G", "b", 1, 100.0, 1.0))
    fresh = PlanProblem(pools, (("G", 6),), ((("a", 10.0), ("b", 30.0)),), (1.0,))
    found = plan(fresh)
    assert found is not None and sum(found.replicas().values()) < 6  # headroom is capped: GPUs left idle
    filled = fill_budget(fresh, found)
    assert sum(filled.replicas().values()) == 6 and filled.predicted_goodput_rps == found.predicted_goodput_rps
    assert filled.replicas()["b@G"] > filled.replicas()["a@G"]  # leftovers follow demand
    kept = PlanProblem(pools, (("G", 6),), ((("a", 10.0), ("b", 30.0)),), (1.0,), current=(("a@G", 5), ("b@G", 1)),
                       move_cost=(("a@G", 0.5), ("b@G", 0.5)))
    assert fill_budget(kept, plan(kept)).replicas() == {"a@G": 5, "b@G": 1}  # nothing worth a move: stay


def test_pool_queue_counts_who_is_ahead_and_expires_anywhere() -> None:
    queue: PoolQueue[str] = PoolQueue(max_len=8)
    queue.offer("i", 0, 5.0)
    queue.offer("s", 1, 2.0)
    queue.offer("b1", 2, 1.0)
    queue.offer("b2", 2, 30.0)
    assert (queue.num_ahead(0), queue.num_ahead(1), queue.num_ahead(2)) == (1, 2, 4)
    assert [s.item for s in queue.expire(3.0)] == ["s", "b1"]  # behind a live interactive entry, still expired
    assert len(queue) == 2 and queue.num_ahead(2) == 2
    assert queue.take(3.0) == ("i", []) and queue.num_ahead(2) == 1


def test_an_overflowing_long_prompt_weighs_its_length_in_a_chat_pool() -> None:
    from fleet.router import work_units

    pool = _pool(in_flight=0)
    long = replace(BATCH, name="long-context", prompt_tokens=6000, predicted_output_p50=300)
    assert work_units(long, pool) == 1.0  # no mean lengths known: one request, one unit
    pool.mean_prompt_tokens, pool.mean_output_tokens = 1000.0, 200.0
    assert work_units(long, pool) == 6.0 and work_units(replace(long, name="short-chat"), pool) == 1.0
    replica = pool.replicas[0]
    replica.begin(6300, work_units(long, pool))
    assert replica.work_in_flight == 6.0 and pool.load_fraction(0.0) == 1.5  # 6 of 4 units: saturated
    replica.end(6300, work_units(long, pool))
    assert replica.work_in_flight == 0.0 and replica.num_in_flight == 0
