"""PerfModel: roofline regimes, KV capacity, tensor parallelism, fast-forward exactness, speculation."""

from __future__ import annotations

import pytest

from kernels.catalog import get_gpu, get_model
from kernels.config import EngineConfig
from kernels.perf import IterationShape, PerfModel


def _perf(model: str = "Llama-3.1-8B", gpu: str = "H100", **config: object) -> PerfModel:
    return PerfModel(get_model(model), get_gpu(gpu), EngineConfig.from_dict(config))


def _decode(num_seqs: int, context: int = 1024) -> IterationShape:
    return IterationShape(num_seqs, num_seqs * context, 0, 0.0)


def test_small_decode_batch_is_bandwidth_bound_and_large_prefill_compute_bound() -> None:
    perf = _perf()
    small = perf.iteration_time(_decode(1))
    assert small.bound == "memory" and small.weights_s > 10 * small.compute_s
    prefill = perf.iteration_time(IterationShape(0, 0, 8192, 8192 * 4096.0, 1))
    assert prefill.bound == "compute"
    # weights dominate at batch 1, so doubling a tiny batch costs almost nothing; at large batch cost scales
    assert perf.iteration_time(_decode(2)).total_s < 1.05 * small.total_s
    assert perf.iteration_time(_decode(1024)).total_s > 5 * small.total_s


def test_fp8_kv_doubles_capacity() -> None:
    bf16, fp8 = _perf(kv_cache_dtype="auto"), _perf(kv_cache_dtype="fp8_e4m3")
    assert fp8.bytes_per_kv_token == bf16.bytes_per_kv_token / 2
    assert fp8.kv_capacity_tokens == pytest.approx(2 * bf16.kv_capacity_tokens, abs=2)


def test_max_total_tokens_caps_the_pool_as_sglang_does() -> None:
    free = _perf()
    capped = _perf(max_total_tokens=20_000)
    assert free.kv_capacity_tokens > 100_000 and capped.kv_capacity_tokens == 20_000
    # a cap above what memory holds changes nothing
    assert _perf(max_total_tokens=10 * free.kv_capacity_tokens).kv_capacity_tokens == free.kv_capacity_tokens
    # sglang derives its auto max_running_requests from the capped pool (clamped to 2048..4096)
    assert _perf("Llama-3.1-8B", "H200").config.max_running_requests > 2048  # a big pool: more slots
    assert _perf("Llama-3.1-8B", "H200", max_total_tokens=20_000).config.max_running_requests == 2048
    assert not _perf(max_total_tokens=100).fits  # a pool too small for a 64th of the context is no serving pool


def test_weights_that_do_not_fit_leave_no_kv() -> None:
    perf = _perf("Llama-3.1-70B", "H100")
    assert perf.kv_capacity_tokens == 0 and not perf.fits
    assert _perf("Llama-3.1-70B", "H100", tp=2).fits


def test_tensor_parallelism_shards_weights_and_adds_allreduce() -> None:
    tp1, tp4 = _perf("Llama-3.1-70B", "H200"), _perf("Llama-3.1-70B", "H200", tp=4)
    assert tp4.weight_bytes_per_gpu == pytest.approx(tp1.weight_bytes_per_gpu / 4)
    one, four = tp1.iteration_time(_decode(8)), tp4.iteration_time(_decode(8))
    assert one.comm_s == 0.0 and four.comm_s > 0.0
    assert four.weights_s == pytest.approx(one.weights_s / 4)
    assert tp4.kv_capacity_tokens > 4 * tp1.kv_capacity_tokens  # less weight per GPU leaves more KV room


def test_quantization_halves_weight_bytes() -> None:
    assert _perf(quantization="fp8").weight_bytes_per_gpu == pytest.approx(_perf().weight_bytes_per_gpu / 2)


def test_mla_latent_is_replicated_across_tp_ranks() -> None:
    deepseek = _perf("DeepSeek-V3", "H200", tp=8)
    assert deepseek.kv_bytes_per_token_per_gpu == 61 * 576 * 2
    assert _perf("DeepSeek-V3", "H200", tp=8, enable_dp_attention=True).kv_capacity_tokens == pytest.approx(8 * deepseek.kv_capacity_tokens, rel=1e-3)


def test_moe_weight_traffic_grows_with_batch() -> None:
    perf = _perf("Qwen3-30B-A3B", "H100")
    one, many = perf.iteration_time(_decode(1)), perf.iteration_time(_decode(256))
    assert many.weights_s > 3 * one.weights_s


def test_longer_prompts_raise_prefill_time_superlinearly() -> None:
    perf = _perf()
    short, long = perf.prefill_time_s(4096), perf.prefill_time_s(32768)
    assert long > 8 * short * 1.1


@pytest.mark.parametrize("num_seqs", [1, 16, 300])
def test_decode_run_time_equals_summed_iterations(num_seqs: int) -> None:
    perf = _perf(cuda_graph_max_bs=64)
    context, steps = num_seqs * 700, 250
    summed = sum(perf.iteration_time(IterationShape(num_seqs, context + k * num_seqs, 0, 0.0)).total_s for k in range(steps))
    assert perf.decode_run_time_s(num_seqs, context, steps) == pytest.approx(summed, rel=1e-12)


def test_decode_run_time_crossing_from_memory_to_compute_bound() -> None:
    perf = _perf("Llama-3.1-8B", "L40S", kv_cache_dtype="fp8_e4m3")
    num_seqs, context, steps = 512, 512 * 16, 400
    shapes = [IterationShape(num_seqs, context + k * num_seqs, 0, 0.0) for k in range(steps)]
    bounds = {perf.iteration_time(s).bound for s in shapes}
    summed = sum(perf.iteration_time(s).total_s for s in shapes)
    assert perf.decode_run_time_s(num_seqs, context, steps) == pytest.approx(summed, rel=1e-12)
    assert bounds  # both regimes or one: the closed form must match either way


def test_speculative_decoding_gains_depend_on_domain_and_batch() -> None:
    plain, spec = _perf(), _perf(speculative_algorithm="EAGLE3")
    assert plain.spec_tokens_per_step("code", 1) == 1.0
    assert spec.spec_tokens_per_step("code", 1) > spec.spec_tokens_per_step("chat", 1) > 2.0
    assert spec.spec_tokens_per_step("chat", 256) < spec.spec_tokens_per_step("chat", 1)
    verify = spec.iteration_time(_decode(64))
    assert verify.draft_s > 0 and verify.compute_s > plain.iteration_time(_decode(64)).compute_s
    steps = 100
    summed = sum(spec.iteration_time(IterationShape(4, 4000 + round(k * 4 * 2.5), 0, 0.0)).total_s for k in range(steps))
    assert spec.decode_run_time_s(4, 4000, steps, tokens_per_step=2.5) == pytest.approx(summed, rel=1e-4)


def test_cuda_graphs_apply_only_to_small_pure_decode() -> None:
    perf = _perf(cuda_graph_max_bs=32)
    assert perf.iteration_time(_decode(32)).cuda_graph
    assert not perf.iteration_time(_decode(33)).cuda_graph
    assert not perf.iteration_time(IterationShape(8, 8000, 100, 5000.0, 1)).cuda_graph
    assert not _perf(disable_cuda_graph=True).iteration_time(_decode(1)).cuda_graph


def test_auto_knobs_are_resolved() -> None:
    config = _perf("Llama-3.1-8B", "H200").config
    assert config.mem_fraction_static and config.chunked_prefill_size and config.cuda_graph_max_bs and config.max_running_requests
