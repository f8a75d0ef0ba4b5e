"""The compute bound: a workload's least work, and that the engine the emulated replicas run never beats it."""

from __future__ import annotations

import random

import pytest

from kernels.catalog import get_gpu, get_model
from kernels.config import EngineConfig
from kernels.engine import Engine
from kernels.engine_types import EngineRequest
from kernels.perf import IterationShape, PerfModel
from loadtest.compute_bound import compute_load, least_work
from loadtest.spec import RequestSpec, Workload
from tests.kernels.engine_helpers import drive


def _spec(prompt: int, output: int, hash_ids: tuple[int, ...] = ()) -> RequestSpec:
    return RequestSpec(0.0, prompt, output, "chat", "t", "standard", hash_ids, None, "x")


def _perf(gpu: str = "H100-SXM", **config: object) -> PerfModel:
    return PerfModel(get_model("llama-3.1-8b"), get_gpu(gpu), EngineConfig.from_dict({"tp": 1, **config}))


def test_a_prefix_seen_before_is_computed_once() -> None:
    first, second = _spec(1100, 10, (1, 2, 3)), _spec(1100, 10, (1, 2, 4))  # two 512-token blocks shared
    work = least_work(Workload("w", (first, second), 2.0))
    new_tokens = 1100 + 10 + (1100 - 1024) + 10
    pairs = (1100**2 / 2 + 10 * 1100 + 50) + ((1100**2 - 1024**2) / 2 + 10 * 1100 + 50)
    assert work.new_tokens_per_s == pytest.approx(new_tokens / 2.0)
    assert work.attention_pairs_per_s == pytest.approx(pairs / 2.0)


def test_a_block_after_an_uncached_one_is_not_reused() -> None:
    # block 7 follows a different first block: a prefix cache cannot serve it
    work = least_work(Workload("w", (_spec(1024, 0, (1, 7)), _spec(1024, 0, (2, 7))), 1.0))
    assert work.new_tokens_per_s == 2048


def test_a_fleet_computes_at_the_sum_of_its_replicas() -> None:
    work = least_work(Workload("w", tuple(_spec(4000, 100) for _ in range(50)), 1.0))
    one = compute_load(work, [_perf()])
    assert compute_load(work, [_perf(), _perf("H200")]) == pytest.approx(one / 2)  # same compute roofline
    assert compute_load(work, [_perf(tp=2)]) == pytest.approx(one / 2)


@pytest.mark.parametrize("gpu,config", [("H100-SXM", {"chunked_prefill_size": 2048}), ("H200", {"chunked_prefill_size": 8192}),
                                        ("H100-SXM", {"tp": 2, "quantization": "fp8"})])
def test_no_iteration_is_priced_below_its_compute_floor(gpu: str, config: dict[str, object]) -> None:
    perf, rng = _perf(gpu, **config), random.Random(3)
    for _ in range(200):
        seqs, chunk = rng.randint(0, 256), rng.choice([0, 1, 512, 2048, 8192])
        context = seqs * rng.randint(1, 8000)
        pairs = chunk * (rng.randint(0, 8000) + chunk / 2)
        it = IterationShape(seqs, context, chunk, pairs, 1 if chunk else 0)
        assert perf.iteration_time(it).total_s >= perf.compute_floor_s(seqs + chunk, context + pairs)


def test_the_engine_takes_at_least_the_floor_of_a_burst() -> None:
    """The emulated replica's own scheduler on a prefill-heavy burst with shared prefixes: it takes no
    less than the bound says (and not far more: the bound is not vacuous)."""
    perf, rng = _perf(chunked_prefill_size=2048), random.Random(5)
    specs = []
    for index in range(40):
        prompt = rng.randint(2000, 6000)
        blocks = (index % 3, *range(1000 * index, 1000 * index + prompt // 512))  # three shared first blocks
        specs.append(_spec(prompt, rng.randint(1, 32), blocks))
    floor_s = compute_load(least_work(Workload("burst", tuple(specs), 1.0)), [perf])  # seconds: the burst over 1 s
    engine = Engine(perf, perf.config)
    arrivals = [(0.0, EngineRequest(f"r{i}", s.input_tokens, s.output_tokens, prefix_hash_ids=s.hash_ids)) for i, s in enumerate(specs)]
    took_s = max(drive(engine, arrivals, fast_forward=True).req_id_to_finished_at.values())
    assert floor_s <= took_s <= 2.0 * floor_s
