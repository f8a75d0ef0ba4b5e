"""Roofline performance model of one engine iteration on one data-parallel rank (a TP group).

Pure and immutable: a PerfModel is built from (model, GPU, config[, params]) and answers how long an
iteration of a given shape takes, how many KV tokens fit, and how far speculative decoding helps.
The equations are written out in kernels/README.md."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from kernels.catalog import GpuSpec, ModelSpec
from kernels.config import FP4_QUANTIZATIONS, FP8_QUANTIZATIONS, EngineConfig
from kernels.perf_params import PerfParams, default_params

_FP4_BYTES = 4.5 / 8  # 4-bit values plus one 8-bit scale per 16 (NVFP4) or 32 (MXFP4, 4.25 bits)
_KV_DTYPE_BYTES = {"auto": 2.0, "bf16": 2.0, "bfloat16": 2.0, "fp8_e4m3": 1.0, "fp8_e5m2": 1.0, "fp4_e2m1": _FP4_BYTES}
_ACTIVATION_BYTES = 2.0  # all-reduce payloads are bf16
# Probability that a draft token is accepted, by algorithm and request domain (EAGLE-3 paper and
# SGLang docs: accept length ~3-4 of 4 on code/math, ~3 on chat; AngelSlim ~2 with small drafters;
# n-gram lookup only pays when output copies the prompt). Unknown domains use "chat".
_ACCEPT_PROB = {
    "EAGLE": {"chat": 0.60, "code": 0.70, "math": 0.70, "summarization": 0.60},
    "EAGLE3": {"chat": 0.70, "code": 0.80, "math": 0.80, "summarization": 0.70},
    "MTP": {"chat": 0.75, "code": 0.85, "math": 0.85, "summarization": 0.75},
    "NGRAM": {"chat": 0.25, "code": 0.45, "math": 0.35, "summarization": 0.60},
}
# Batch size at which the speculative gain per sequence halves (draft trees are pruned and the
# verify step stops being free once the batch is compute bound; EAGLE-3 reports 2.4x at bs 1 but
# 1.38x at bs 64, part of which iteration_time already charges as verify FLOPs).
_SPEC_HALF_BATCH = 128.0


@dataclass(frozen=True, slots=True)
class IterationShape:
    """What one engine iteration computes."""

    num_decode_seqs: int  # sequences emitting a token this iteration
    sum_decode_context: int  # sum of their context lengths (tokens of KV read)
    num_prefill_tokens: int  # new prompt tokens computed this iteration (sum of chunk lengths)
    prefill_attn_pairs: float  # sum over prefill chunks of chunk_len * (cached_before + chunk_len / 2)
    num_prefill_seqs: int = 0


@dataclass(frozen=True, slots=True)
class IterationTime:
    """Breakdown of one iteration, seconds. total = max(memory, compute) + comm + overhead + draft."""

    total_s: float
    weights_s: float  # HBM time to stream the weights (per TP shard)
    kv_s: float  # HBM time to read the decode KV cache and write new KV
    compute_s: float  # tensor-core time of all FLOPs
    comm_s: float  # TP all-reduce time
    overhead_s: float  # CPU scheduling, launches, per-layer kernel floors
    draft_s: float = 0.0  # speculative draft steps
    cuda_graph: bool = False  # whether the iteration ran as a captured CUDA graph

    @property
    def memory_s(self) -> float:
        return self.weights_s + self.kv_s

    @property
    def bound(self) -> str:
        return "compute" if self.compute_s > self.memory_s else "memory"


@dataclass(frozen=True, slots=True)
class _Affine:
    """time(ctx) = max(mem0 + mem1*ctx, cmp0 + cmp1*ctx) + fixed, for one decode batch size."""

    mem0: float
    mem1: float
    cmp0: float
    cmp1: float
    fixed: float

    def at(self, ctx: float) -> float:
        return max(self.mem0 + self.mem1 * ctx, self.cmp0 + self.cmp1 * ctx) + self.fixed

    def summed(self, ctx0: float, step: float, num_steps: int) -> float:
        """Exact sum of at(ctx0 + k*step) for k in [0, num_steps): each side is affine, so split at the crossover."""
        if num_steps <= 0:
            return 0.0
        a0, a1 = self.mem0 + self.mem1 * ctx0, self.mem1 * step
        b0, b1 = self.cmp0 + self.cmp1 * ctx0, self.cmp1 * step

        def arith(c0: float, c1: float, first: int, last: int) -> float:  # sum over k in [first, last)
            count = last - first
            return c0 * count + c1 * (first + last - 1) * count / 2 if count > 0 else 0.0

        if a1 == b1:
            crossover = num_steps if a0 >= b0 else 0
        else:
            # memory side wins while a0 + a1*k >= b0 + b1*k
            k_star = (b0 - a0) / (a1 - b1)
            crossover = min(num_steps, max(0, math.ceil(k_star))) if a1 > b1 else min(num_steps, max(0, math.floor(k_star) + 1))
        if a1 > b1:  # compute first, then memory
            total = arith(b0, b1, 0, crossover) + arith(a0, a1, crossover, num_steps)
        else:  # memory first, then compute
            total = arith(a0, a1, 0, crossover) + arith(b0, b1, crossover, num_steps)
        return total + self.fixed * num_steps


class PerfModel:
    """Iteration-time and capacity model for `model` served on `gpu` with `config` (one DP rank)."""

    def __init__(self, model: ModelSpec, gpu: GpuSpec, config: EngineConfig, params: PerfParams | None = None) -> None:
        self.model = model
        self.gpu = gpu
        self.params = params or default_params()
        self._raw_config = config
        self._dense_bytes, self._expert_bytes = _weight_bytes_per_param(model, config.quantization)
        self.compute_precision = gpu.native_precision(_compute_precision(model, config.quantization))
        self._kv_bytes = _KV_DTYPE_BYTES[config.kv_cache_dtype]
        self.config = self._resolve(config)

    # ----- memory -------------------------------------------------------------------------------
    @property
    def weight_bytes_per_gpu(self) -> float:
        """Weights resident on each GPU of the TP group (experts sharded over tp*ep... see README)."""
        m, tp = self.model, self._raw_config.tp
        return (m.dense_params + m.embedding_params) * self._dense_bytes / tp + m.routed_expert_params * self._expert_bytes / tp

    @property
    def kv_bytes_per_token_per_gpu(self) -> float:
        """KV bytes one cached token occupies on each GPU (heads split over TP, replicated past kv_heads;
        MLA's latent is replicated on every rank unless attention is data-parallel)."""
        m, tp = self.model, self._raw_config.tp
        if self._raw_config.enable_dp_attention:
            return m.kv_elements_per_token * self._kv_bytes / tp
        if m.is_mla:
            return m.kv_elements_per_token * self._kv_bytes
        heads_per_rank = math.ceil(m.num_kv_heads / tp)
        return m.num_full_attention_layers * 2 * heads_per_rank * m.head_dim * self._kv_bytes

    @property
    def bytes_per_kv_token(self) -> float:
        """HBM one cached token costs the whole TP group (sum over ranks, replication included)."""
        return self.kv_bytes_per_token_per_gpu * self._raw_config.tp

    @property
    def kv_capacity_tokens(self) -> int:
        """KV tokens that fit per replica, capped by `max_total_tokens` as sglang caps its pool; 0 when
        the weights alone do not fit."""
        free = self.gpu.hbm_bytes * self.config.mem_fraction_static - self.weight_bytes_per_gpu  # type: ignore[operator]
        return int(_capped(max(0, free // self.kv_bytes_per_token_per_gpu), self.config.max_total_tokens))

    @property
    def fits(self) -> bool:
        return self.kv_capacity_tokens >= self.model.max_context // 64

    # ----- time ---------------------------------------------------------------------------------
    def iteration_time(self, it: IterationShape) -> IterationTime:
        """Time of one iteration of shape `it` (decode and prefill may be mixed)."""
        verify = self.verify_tokens_per_seq
        num_tokens = it.num_decode_seqs * verify + it.num_prefill_tokens
        if num_tokens == 0:
            return IterationTime(0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
        bw = self.gpu.hbm_bytes_per_s * self._bw_eff
        weights_s = self._weight_bytes_touched(num_tokens) / bw
        kv_bytes = (
            it.sum_decode_context * self.kv_bytes_per_token_per_gpu
            + it.num_decode_seqs * self._sliding_kv_bytes_per_seq
            + num_tokens * self.kv_bytes_per_token_per_gpu  # writing the new tokens' KV
        )
        kv_s = kv_bytes / bw
        compute_s = self._flops(num_tokens, it.sum_decode_context * verify, it.prefill_attn_pairs) / self._flops_per_s
        graph = self._uses_cuda_graph(it)
        overhead_s = self._overhead_s(it.num_decode_seqs + it.num_prefill_seqs, graph)
        comm_s = self._comm_s(num_tokens)
        draft_s = self._draft_s(it.num_decode_seqs) if it.num_decode_seqs else 0.0
        total = max(weights_s + kv_s, compute_s) + comm_s + overhead_s + draft_s
        return IterationTime(total, weights_s, kv_s, compute_s, comm_s, overhead_s, draft_s, graph)

    def decode_run_time_s(self, num_decode_seqs: int, sum_context: int, num_steps: int, tokens_per_step: float = 1.0) -> float:
        """Total time of `num_steps` pure-decode iterations of `num_decode_seqs` sequences whose summed
        context starts at `sum_context` and grows by num_decode_seqs*tokens_per_step each step.
        Equals the sum of iteration_time over those steps (closed form, for fast-forwarding)."""
        if num_decode_seqs <= 0 or num_steps <= 0:
            return 0.0
        return self._decode_affine(num_decode_seqs).summed(float(sum_context), num_decode_seqs * tokens_per_step, num_steps)

    def prefill_time_s(self, prompt_tokens: int, cached_tokens: int = 0) -> float:
        """Time to prefill one prompt alone, chunked as the config says (no other work in the batch)."""
        chunk = self.config.chunked_prefill_size or prompt_tokens
        chunk = prompt_tokens if chunk <= 0 else chunk
        total, done = 0.0, cached_tokens
        while done < prompt_tokens:
            size = min(chunk, prompt_tokens - done)
            pairs = size * (done + size / 2)
            total += self.iteration_time(IterationShape(0, 0, size, pairs, 1)).total_s
            done += size
        return total

    def compute_floor_s(self, num_tokens: float, attention_pairs: float) -> float:
        """The least time this replica can spend on ``num_tokens`` new tokens (prefill or decode) that attend
        over ``attention_pairs`` (query, context) pairs in all: their FLOPs at the compute roofline, with no
        memory stall, communication or per-step overhead. ``iteration_time`` never prices a batch below
        it, so work over it bounds the throughput of any schedule of that work."""
        return self._flops(num_tokens, attention_pairs, 0.0) / self._flops_per_s

    @property
    def request_overhead_s(self) -> float:
        """Fixed per-request latency outside the iterations (HTTP, tokenisation); added to TTFT."""
        return self.params.request_overhead_s

    # ----- speculative decoding -----------------------------------------------------------------
    @property
    def verify_tokens_per_seq(self) -> int:
        """Tokens each decoding sequence pushes through the target model per iteration (1 without speculation)."""
        if self.config.speculative_algorithm is None:
            return 1
        return int(self.config.speculative_num_draft_tokens)  # type: ignore[arg-type]

    def spec_tokens_per_step(self, domain: str, num_decode_seqs: int) -> float:
        """Expected tokens emitted per sequence per decode step with the configured speculation."""
        algorithm = self.config.speculative_algorithm
        if algorithm is None:
            return 1.0
        table = _ACCEPT_PROB[algorithm]
        alpha = table.get(domain, table["chat"])
        drafts = self.verify_tokens_per_seq - 1
        accepted = (1.0 - alpha ** (drafts + 1)) / (1.0 - alpha)  # chain: 1 bonus token + accepted prefix
        shrink = 1.0 / (1.0 + max(0, num_decode_seqs - 1) / _SPEC_HALF_BATCH)
        return 1.0 + (accepted - 1.0) * shrink

    # ----- internals ----------------------------------------------------------------------------
    @property
    def _bw_eff(self) -> float:
        return self.params.bandwidth_efficiency * self.params.vendor_efficiency.get(self.gpu.vendor, 1.0)

    @property
    def _flops_per_s(self) -> float:
        eff = self.params.compute_efficiency[self.compute_precision] * self.params.vendor_efficiency.get(self.gpu.vendor, 1.0)
        return self.gpu.peak_flops(self.compute_precision) * eff

    @property
    def _sliding_kv_bytes_per_seq(self) -> float:
        m = self.model
        if not m.num_sliding_layers:
            return 0.0
        per_layer = self.kv_bytes_per_token_per_gpu / max(1, m.num_full_attention_layers)
        return m.num_sliding_layers * m.sliding_window * per_layer

    def _weight_bytes_touched(self, num_tokens: float) -> float:
        """Weight bytes streamed per GPU: all dense weights, plus the routed experts some token picks
        (uniform routing: an expert stays idle with probability (1 - k/E)^tokens)."""
        m, tp = self.model, self._raw_config.tp
        dense = m.dense_params * self._dense_bytes / tp
        if not m.is_moe:
            return dense
        idle = (1.0 - m.num_experts_per_tok / m.num_experts) ** num_tokens
        return float(dense + m.routed_expert_params * (1.0 - idle) * self._expert_bytes / tp)

    def _flops(self, num_tokens: float, decode_query_context: float, prefill_attn_pairs: float) -> float:
        """FLOPs per GPU, with routed-expert FLOPs inflated by 1 / moe_compute_efficiency."""
        m = self.model
        routed = m.num_moe_layers * m.num_experts_per_tok * m.expert_params
        linear = 2.0 * (m.active_params - routed + routed / self.params.moe_compute_efficiency) * num_tokens
        per_pair = m.attention_flops_per_token_per_context * m.num_full_attention_layers / m.num_layers
        attention = per_pair * (decode_query_context + prefill_attn_pairs)
        return (linear + attention) / self._raw_config.tp

    def _comm_s(self, num_tokens: float) -> float:
        tp = self._raw_config.tp
        if tp == 1:
            return 0.0
        payload = num_tokens * self.model.hidden_size * _ACTIVATION_BYTES
        link = self.gpu.interconnect_bytes_per_s * self.params.interconnect_efficiency
        per_allreduce = self.params.allreduce_latency_s + 2.0 * (tp - 1) / tp * payload / link
        return 2 * self.model.num_layers * per_allreduce

    def _uses_cuda_graph(self, it: IterationShape) -> bool:
        cfg = self.config
        return (not cfg.disable_cuda_graph and it.num_prefill_tokens == 0 and 0 < it.num_decode_seqs <= (cfg.cuda_graph_max_bs or 0))

    def _overhead_s(self, num_seqs: int, graph: bool) -> float:
        p, m = self.params, self.model
        per_layer = p.layer_floor_s if graph else p.layer_launch_s
        return p.step_overhead_s + p.per_seq_overhead_s * num_seqs + m.num_layers * per_layer + m.num_moe_layers * p.moe_layer_floor_s

    def _draft_s(self, num_decode_seqs: int) -> float:
        cfg = self.config
        if cfg.speculative_algorithm is None or cfg.speculative_algorithm == "NGRAM":
            return 0.0
        # A draft step runs one decoder layer plus the lm_head for every sequence.
        m = self.model
        layer_bytes = (m.dense_params - m.vocab_size * m.hidden_size) / m.num_layers * self._dense_bytes
        head_bytes = m.vocab_size * m.hidden_size * self._dense_bytes
        step_s = (layer_bytes + head_bytes) / self._raw_config.tp / (self.gpu.hbm_bytes_per_s * self._bw_eff)
        return int(cfg.speculative_num_steps) * (step_s + self.params.draft_step_overhead_s + self.params.layer_floor_s)  # type: ignore[arg-type]

    def _decode_affine(self, num_decode_seqs: int) -> _Affine:
        """The pure-decode iteration time of `num_decode_seqs` sequences as an affine function of summed context."""
        at0 = self.iteration_time(IterationShape(num_decode_seqs, 0, 0, 0.0))
        bw = self.gpu.hbm_bytes_per_s * self._bw_eff
        mem1 = self.kv_bytes_per_token_per_gpu / bw
        per_pair = self.model.attention_flops_per_token_per_context * self.model.num_full_attention_layers / self.model.num_layers
        cmp1 = per_pair * self.verify_tokens_per_seq / self._raw_config.tp / self._flops_per_s
        return _Affine(at0.memory_s, mem1, at0.compute_s, cmp1, at0.comm_s + at0.overhead_s + at0.draft_s)

    def _resolve(self, config: EngineConfig) -> EngineConfig:
        """Fill sglang's start-up "auto" knobs the way sglang derives them from GPU memory and model."""
        hbm_gb = self.gpu.hbm_gb
        mem_fraction = config.mem_fraction_static
        if mem_fraction is None:
            # sglang's TP-dependent default, but never reserving more than ~12 GB on big-memory parts.
            by_tp = 0.79 if config.tp >= 16 else 0.81 if config.tp >= 8 else 0.85 if config.tp >= 4 else 0.87 if config.tp >= 2 else 0.88
            mem_fraction = round(max(by_tp, 1.0 - 12.0 / hbm_gb), 3)
        chunk = config.chunked_prefill_size
        if chunk is None:
            chunk = 2048 if hbm_gb < 35 else 4096 if hbm_gb < 60 else 8192 if hbm_gb < 160 else 16384
        graph_bs = config.cuda_graph_max_bs
        if graph_bs is None:
            graph_bs = 80 if hbm_gb < 60 else 256 if hbm_gb < 90 else 512
        steps, drafts = config.speculative_num_steps, config.speculative_num_draft_tokens
        if config.speculative_algorithm is not None:
            steps = steps if steps is not None else (drafts - 1 if drafts else 3)
            drafts = drafts if drafts is not None else steps + 1
        resolved = replace(config, mem_fraction_static=mem_fraction, chunked_prefill_size=chunk, cuda_graph_max_bs=graph_bs,
                           speculative_num_steps=steps, speculative_num_draft_tokens=drafts)
        if resolved.max_running_requests is None:
            pool = self.gpu.hbm_bytes * mem_fraction - self.weight_bytes_per_gpu
            tokens = _capped(max(0.0, pool / self.kv_bytes_per_token_per_gpu), config.max_total_tokens)
            auto = int(min(4096, max(2048, tokens / self.model.max_context * 512)))
            resolved = replace(resolved, max_running_requests=auto)
        return resolved


def _capped(tokens: float, max_total_tokens: int | None) -> float:
    """The pool sglang allocates: what memory holds, or `--max-total-tokens` when that is smaller."""
    return tokens if max_total_tokens is None else min(tokens, max_total_tokens)


def _weight_bytes_per_param(model: ModelSpec, quantization: str | None) -> tuple[float, float]:
    """(bytes per dense parameter, bytes per routed-expert parameter) for the served checkpoint."""
    native_dense = 1.0 if model.weight_dtype == "fp8" else 2.0
    native_expert = {"fp8": 1.0, "mxfp4_experts": 4.25 / 8}.get(model.weight_dtype, 2.0)
    if quantization in FP4_QUANTIZATIONS:
        return _FP4_BYTES, min(native_expert, _FP4_BYTES)
    if quantization in FP8_QUANTIZATIONS:
        return 1.0, min(native_expert, 1.0)
    return native_dense, native_expert


def _compute_precision(model: ModelSpec, quantization: str | None) -> str:
    if quantization in FP4_QUANTIZATIONS:
        return "fp4"
    if quantization in FP8_QUANTIZATIONS or model.weight_dtype in ("fp8", "mxfp4_experts"):
        return "fp8"
    return "bf16"
