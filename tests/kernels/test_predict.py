"""Predictions: offline steady state, simulated closed and open loads, and the SLO search."""

from __future__ import annotations

import pytest

from kernels.catalog import get_gpu, get_model
from kernels.config import EngineConfig
from kernels.perf import IterationShape, PerfModel
from kernels.predict import Workload, max_rate_under_slo, predict


def _perf(**config: object) -> PerfModel:
    return PerfModel(get_model("Llama-3.1-8B"), get_gpu("H100"), EngineConfig.from_dict(config))


def test_single_client_sees_one_sequence_decode_time() -> None:
    perf = _perf()
    result = predict(perf, Workload(512, 128, concurrency=1, num_requests=8))
    step = perf.iteration_time(IterationShape(1, 512 + 64, 0, 0.0)).total_s
    assert result.method == "simulated"
    assert result.tpot_mean_s == pytest.approx(step, rel=0.02)
    assert result.ttft_mean_s == pytest.approx(perf.prefill_time_s(512) + perf.request_overhead_s, rel=0.02)


def test_more_clients_raise_throughput_and_tpot() -> None:
    perf = _perf()
    low, high = (predict(perf, Workload(1024, 256, concurrency=c)) for c in (4, 64))
    assert high.output_tok_s > 4 * low.output_tok_s
    assert high.tpot_mean_s > low.tpot_mean_s
    assert 0.0 < low.kv_usage < high.kv_usage < 1.0


def test_offline_throughput_exceeds_any_latency_bound_load() -> None:
    perf = _perf()
    offline = predict(perf, Workload(1024, 1024))
    assert offline.method == "steady-state"
    assert offline.output_tok_s > predict(perf, Workload(1024, 1024, concurrency=32)).output_tok_s


def test_data_parallel_ranks_multiply_throughput() -> None:
    one, two = predict(_perf(), Workload(512, 512)), predict(_perf(dp=2), Workload(512, 512))
    assert two.output_tok_s == pytest.approx(2 * one.output_tok_s)
    assert two.output_tok_s_per_gpu == pytest.approx(one.output_tok_s_per_gpu)


def test_poisson_ttft_grows_with_rate() -> None:
    perf = _perf()
    calm, busy = (predict(perf, Workload(2048, 128, rate=r, num_requests=200)) for r in (1.0, 20.0))
    assert busy.ttft_p99_s > calm.ttft_p99_s
    assert calm.request_rate == pytest.approx(1.0, rel=0.25)


def test_max_rate_under_slo_is_monotone_in_the_target() -> None:
    perf = _perf()
    mix = [Workload(1024, 128, num_requests=150)]
    tight = max_rate_under_slo(perf, mix, ttft_p99_s=0.15, tpot_p99_s=0.02)
    loose = max_rate_under_slo(perf, mix, ttft_p99_s=1.0, tpot_p99_s=0.05)
    assert 0.0 < tight < loose
    assert max_rate_under_slo(perf, mix, ttft_p99_s=1e-4) == 0.0
