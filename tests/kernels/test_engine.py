"""The continuous-batching scheduler: admission, chunked prefill, preemption, prefix cache, fast-forward."""

from __future__ import annotations

import dataclasses
import random

import pytest

from kernels.catalog import get_gpu, get_model
from kernels.config import EngineConfig
from kernels.engine import Engine, run_until
from kernels.engine_types import EngineRequest
from kernels.perf import PerfModel
from tests.kernels.engine_helpers import TablePerf, drive, make_engine


def _requests(num: int, prompt_tokens: int, output_tokens: int, spacing_s: float = 0.0) -> list[tuple[float, EngineRequest]]:
    return [(i * spacing_s, EngineRequest(f"r{i}", prompt_tokens, output_tokens, arrived_at=i * spacing_s)) for i in range(num)]


def _mixed_arrivals(seed: int, num: int, rate_per_s: float) -> list[tuple[float, EngineRequest]]:
    rng = random.Random(seed)
    arrivals, now = [], 0.0
    for i in range(num):
        now += rng.expovariate(rate_per_s)
        req = EngineRequest(
            f"r{i}",
            prompt_tokens=rng.randint(16, 3000),
            output_tokens=rng.randint(1, 400),
            domain=rng.choice(("chat", "code")),
            prefix_hash_ids=(rng.randint(0, 2), rng.randint(0, 5)) if rng.random() < 0.5 else (),
            arrived_at=now,
        )
        arrivals.append((now, req))
    return arrivals


def test_admission_respects_max_running_requests() -> None:
    engine = make_engine(TablePerf(kv_capacity_tokens=1_000_000), max_running_requests=4)
    trace = drive(engine, _requests(10, 100, 20), fast_forward=False)
    assert trace.max_num_running == 4
    assert trace.req_id_to_tokens == {f"r{i}": 20 for i in range(10)}


def test_admission_respects_kv_capacity() -> None:
    # 3000 tokens of KV hold four 600-token prompts with their reserve, never all ten.
    engine = make_engine(TablePerf(kv_capacity_tokens=3000), page_size=16)
    plan = engine.schedule(0.0) if all(engine.add_request(r, 0.0) for _, r in _requests(10, 600, 50)) else None
    assert plan is not None and 1 <= len(plan.prefill_req_ids) < 5
    engine.update(plan, plan.ended_at)
    trace = drive(engine, [], fast_forward=False)
    assert trace.max_kv_used_tokens <= 3000
    assert engine.stats(0.0).num_finished == 10


def test_chunked_prefill_splits_long_prompts() -> None:
    engine = make_engine(TablePerf(kv_capacity_tokens=100_000), chunked_prefill_size=256)
    assert engine.add_request(EngineRequest("long", 1000, 3), 0.0)
    chunks, now = [], 0.0
    while True:
        plan = engine.schedule(now)
        if plan is None:
            break
        chunks.extend(plan.prefill_num_tokens)
        now = plan.ended_at
        outputs = engine.update(plan, now)
        if outputs.first_token_req_ids:
            assert chunks == [256, 256, 256, 232]
    assert chunks == [256, 256, 256, 232]


def test_prefill_budget_shares_with_decode_tokens() -> None:
    engine = make_engine(TablePerf(kv_capacity_tokens=100_000), chunked_prefill_size=512)
    for _, req in _requests(3, 10, 50):
        engine.add_request(req, 0.0)
    plan = engine.schedule(0.0)
    assert plan is not None
    engine.update(plan, plan.ended_at)
    engine.add_request(EngineRequest("big", 2000, 5), plan.ended_at)
    plan = engine.schedule(plan.ended_at)
    assert plan is not None and plan.decode_req_ids == ("r0", "r1", "r2")
    assert plan.prefill_num_tokens == (512 - 3,)


def test_preemption_when_kv_runs_out_and_every_request_completes_exactly() -> None:
    engine = make_engine(TablePerf(kv_capacity_tokens=4096), page_size=16, max_running_requests=64)
    arrivals = [(0.0, EngineRequest(f"r{i}", 300, 200 + 37 * i)) for i in range(12)]
    trace = drive(engine, arrivals, fast_forward=False)
    stats = engine.stats(0.0)
    assert stats.num_preemptions > 0
    assert trace.req_id_to_tokens == {req.req_id: req.output_tokens for _, req in arrivals}
    assert trace.max_kv_used_tokens <= 4096
    assert stats.kv_used_tokens == 0 and stats.num_running == 0


def test_prefix_cache_hits_skip_cached_blocks() -> None:
    engine = make_engine(TablePerf(kv_capacity_tokens=100_000), chunked_prefill_size=8192)
    hash_ids = (11, 12, 13, 14)
    drive(engine, [(0.0, EngineRequest("first", 2100, 2, prefix_hash_ids=hash_ids))], fast_forward=False)
    engine.add_request(EngineRequest("second", 2100, 2, prefix_hash_ids=hash_ids), 1.0)
    engine.add_request(EngineRequest("other", 2100, 2, prefix_hash_ids=(99, 12, 13, 14)), 1.0)
    plan = engine.schedule(1.0)
    assert plan is not None and plan.prefill_num_tokens == (2100 - 4 * 512, 2100)
    outputs = engine.update(plan, plan.ended_at)
    assert outputs.first_token_num_cached == (2048, 0)
    assert engine.stats(plan.ended_at).cache_hit_rate == pytest.approx(2048 / (3 * 2100))


def test_unreferenced_prefix_blocks_are_evicted_when_memory_is_short() -> None:
    engine = make_engine(TablePerf(kv_capacity_tokens=4096), page_size=16)
    drive(engine, [(0.0, EngineRequest("a", 2100, 2, prefix_hash_ids=(1, 2, 3, 4)))], fast_forward=False)
    assert engine.kv.num_cached_blocks == 4
    trace = drive(engine, [(0.0, EngineRequest("b", 3000, 40, prefix_hash_ids=(7, 8, 9)))], fast_forward=False)
    assert trace.req_id_to_tokens == {"b": 40}
    assert engine.kv.num_cached_blocks < 7


def test_lpm_admits_the_longest_cached_prefix_first() -> None:
    engine = make_engine(TablePerf(kv_capacity_tokens=100_000), schedule_policy="lpm", max_running_requests=1)
    drive(engine, [(0.0, EngineRequest("warm", 1100, 1, prefix_hash_ids=(5, 6)))], fast_forward=False)
    engine.add_request(EngineRequest("cold", 1100, 1, prefix_hash_ids=(8, 9)), 0.0)
    engine.add_request(EngineRequest("hot", 1100, 1, prefix_hash_ids=(5, 6)), 0.0)
    plan = engine.schedule(0.0)
    assert plan is not None and plan.prefill_req_ids == ("hot",)


@pytest.mark.parametrize("tokens_per_step", [1.0, 2.37])
def test_fast_forward_equals_stepping_one_by_one(tokens_per_step: float) -> None:
    perf = TablePerf(
        kv_capacity_tokens=60_000,
        per_context_s=1e-8 if tokens_per_step == 1.0 else 0.0,
        domain_to_tokens_per_step={"code": tokens_per_step},
    )
    arrivals = _mixed_arrivals(seed=7, num=120, rate_per_s=20.0)
    stepped = drive(make_engine(perf, page_size=16, max_running_requests=24), arrivals, fast_forward=False)
    fast = drive(make_engine(perf, page_size=16, max_running_requests=24), arrivals, fast_forward=True)
    assert fast.req_id_to_tokens == stepped.req_id_to_tokens == {r.req_id: r.output_tokens for _, r in arrivals}
    assert fast.req_id_to_first_at == pytest.approx(stepped.req_id_to_first_at, rel=1e-9)
    assert fast.req_id_to_finished_at == pytest.approx(stepped.req_id_to_finished_at, rel=1e-9)
    assert fast.num_plans < stepped.num_plans / 3


def test_fast_forward_stops_before_kv_runs_out() -> None:
    perf = TablePerf(kv_capacity_tokens=2048)
    arrivals = [(0.0, EngineRequest(f"r{i}", 200, 600)) for i in range(4)]
    stepped = drive(make_engine(perf, page_size=16), arrivals, fast_forward=False)
    fast = drive(make_engine(perf, page_size=16), arrivals, fast_forward=True)
    assert fast.req_id_to_finished_at == pytest.approx(stepped.req_id_to_finished_at, rel=1e-9)
    assert fast.max_kv_used_tokens <= 2048


def test_runs_are_deterministic() -> None:
    perf = TablePerf(kv_capacity_tokens=30_000, domain_to_tokens_per_step={"code": 1.7})
    arrivals = _mixed_arrivals(seed=3, num=80, rate_per_s=30.0)
    first = drive(make_engine(perf, page_size=16), arrivals, fast_forward=True)
    second = drive(make_engine(perf, page_size=16), arrivals, fast_forward=True)
    assert first.outputs == second.outputs


def test_abort_frees_memory_and_in_flight_plan_skips_it() -> None:
    engine = make_engine(TablePerf(kv_capacity_tokens=10_000))
    engine.add_request(EngineRequest("keep", 100, 5), 0.0)
    engine.add_request(EngineRequest("drop", 100, 5), 0.0)
    plan = engine.schedule(0.0)
    assert plan is not None and plan.prefill_req_ids == ("keep", "drop")
    assert engine.abort("drop", 0.001)
    outputs = engine.update(plan, plan.ended_at)
    assert outputs.new_token_req_ids == ("keep",)
    assert not engine.abort("drop", 0.002)
    assert engine.abort("keep", 0.002)
    assert engine.stats(0.002).kv_used_tokens == 0 and engine.stats(0.002).num_aborted == 2


def test_plans_and_outputs_are_frozen_values() -> None:
    engine = make_engine(TablePerf(kv_capacity_tokens=10_000))
    engine.add_request(EngineRequest("a", 50, 3), 0.0)
    plan = engine.schedule(0.0)
    assert plan is not None
    before = (plan.prefill_req_ids, plan.prefill_num_tokens, plan.duration_s)
    outputs = engine.update(plan, plan.ended_at)
    engine.add_request(EngineRequest("b", 50, 3), plan.ended_at)
    run_until(engine, plan.ended_at, 10.0)
    assert (plan.prefill_req_ids, plan.prefill_num_tokens, plan.duration_s) == before
    assert outputs.new_token_req_ids == ("a",)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.num_steps = 2  # type: ignore[misc]


def test_request_that_can_never_fit_is_refused() -> None:
    engine = make_engine(TablePerf(kv_capacity_tokens=1000))
    assert not engine.add_request(EngineRequest("huge", 900, 200), 0.0)
    assert not engine.has_work()


def test_runs_unchanged_on_the_roofline_model() -> None:
    perf = PerfModel(get_model("llama-3.1-8b"), get_gpu("H100-SXM"), EngineConfig(speculative_algorithm="EAGLE3"))
    engine = Engine(perf, perf.config)
    arrivals = _mixed_arrivals(seed=1, num=50, rate_per_s=10.0)
    trace = drive(engine, arrivals, fast_forward=True)
    assert trace.req_id_to_tokens == {r.req_id: r.output_tokens for _, r in arrivals}
    ttft_s = [trace.req_id_to_first_at[r.req_id] - at for at, r in arrivals]
    assert min(ttft_s) > 0.0 and max(ttft_s) < 2.0
