"""The capacity model counts prefix-cache hits: telemetry measures the share of prompt tokens engines
served from their cache (the responses' cached tokens; the simulator's oracle: hash ids), and the
prediction runs the engine with that much of every prompt shared."""

from __future__ import annotations

from dataclasses import replace

import pytest

from fleet.capacity import PerfCapacity, shared_prefix_tokens
from fleet.simulator.traffic import reusable_prefix_tokens
from fleet.telemetry import ShapeLoad, Telemetry
from kernels.catalog import get_gpu, get_model
from kernels.config import MAX_PREFIX_SHARE, EngineConfig
from kernels.perf import PerfModel
from kernels.predict import Workload, max_rate_under_slo, saturated_rate_rps, simulate
from kernels.tiers import DEFAULT_TIERS
from loadtest.spec import RequestSpec


def _window_share(prompt_tokens: int, cached_tokens: int) -> float:
    tel = Telemetry(window_s=20.0, bucket_s=5.0)
    for k in range(40):
        tel.record_arrival(k * 0.5, "chat", "interactive", prompt_tokens)
        tel.record_outcome(k * 0.5, "chat", "p", True, 100, cached_tokens, prompt_tokens if cached_tokens else 0)
    (load,) = tel.window(20.0).shapes
    return load.prefix_share


def test_telemetry_measures_the_share_of_prompts_served_from_the_cache() -> None:
    assert _window_share(1100, 1024) == pytest.approx(1024 / 1100)
    assert _window_share(1100, 0) == 0.0  # nothing cached, or an engine that does not report it
    assert _window_share(1100, 1100) == MAX_PREFIX_SHARE  # the last token is always computed


def test_a_cached_prefix_raises_capacity_unless_the_engine_caches_nothing() -> None:
    capacity = PerfCapacity("llama-3.1-8b", num_requests=200, rel_tol=0.1)
    slo = DEFAULT_TIERS["interactive"]
    full = ShapeLoad("chat", 1.0, 1100.0, 200.0, (("interactive", 1.0),), (1024, 1217), (200,))
    shared = replace(full, prefix_share=0.9)
    no_cache = EngineConfig(enable_prefix_caching=False)
    assert shared_prefix_tokens(full, EngineConfig()) == shared_prefix_tokens(shared, no_cache) == 0
    assert 900 < shared_prefix_tokens(shared, EngineConfig()) < 1100
    rate_full = capacity.estimate("H100-SXM", EngineConfig(), full, slo).rate_rps
    assert capacity.estimate("H100-SXM", EngineConfig(), shared, slo).rate_rps > 1.5 * rate_full
    assert capacity.estimate("H100-SXM", no_cache, shared, slo).rate_rps == capacity.estimate("H100-SXM", no_cache, full, slo).rate_rps


def test_a_shared_prefix_is_prefilled_once_and_short_prompts_are_not_starved_by_the_chunk() -> None:
    perf = PerfModel(get_model("llama-3.1-8b"), get_gpu("H100-SXM"), EngineConfig(chunked_prefill_size=2048))
    alone = simulate(perf, [Workload(2048, 100, rate=8.0, num_requests=200)], [1.0])
    shared = simulate(perf, [Workload(2048, 100, rate=8.0, num_requests=200, shared_prefix_tokens=1536)], [1.0])
    assert shared.ttft_p50_s < 0.6 * alone.ttft_p50_s  # a quarter of each prompt is prefilled
    # 1,060-token prompts behind a 1,024-token prefix: the search reaches what the engine sustains (38 req/s
    # saturated), not the 2.5 req/s of a closed form whose decode batch fills the chunk
    slo = DEFAULT_TIERS["interactive"]
    chat = [Workload(1060, 200, num_requests=200, shared_prefix_tokens=1024)]
    found = max_rate_under_slo(perf, chat, ttft_p99_s=slo.ttft_p99_s, tpot_p99_s=slo.tpot_p99_s, rel_tol=0.1)
    assert 0.85 * saturated_rate_rps(perf, chat, [1.0]) < found <= saturated_rate_rps(perf, chat, [1.0])
    with pytest.raises(ValueError, match="shared_prefix_tokens"):
        Workload(100, 10, shared_prefix_tokens=100)


def _spec(arrival_s: float, tokens: int, hash_ids: tuple[int, ...]) -> RequestSpec:
    return RequestSpec(arrival_s, tokens, 10, "chat", "t", "interactive", hash_ids=hash_ids)


def test_reusable_prefix_counts_leading_blocks_an_earlier_request_sent() -> None:
    specs = [
        _spec(0.0, 1500, (1, 2, 3)),  # first: nothing cached
        _spec(1.0, 1500, (1, 2, 4)),  # shares two leading blocks
        _spec(2.0, 1500, (9, 2, 3)),  # block 2 again, but after another first block: a different prefix
        _spec(3.0, 1000, (1, 2)),  # its whole prompt was sent before: all but its last token
    ]
    assert reusable_prefix_tokens(specs) == [0, 1024, 0, 999]
