"""A table-driven performance model and a virtual-clock driver for the engine tests."""

from __future__ import annotations

from dataclasses import dataclass, field

from kernels.config import EngineConfig
from kernels.engine import Engine
from kernels.engine_types import EngineRequest, StepOutputs
from kernels.perf import IterationShape


@dataclass(frozen=True, slots=True)
class TableTime:
    total_s: float


@dataclass(frozen=True)
class TablePerf:
    """Iteration time = fixed + per-seq + per-context-token + per-prefill-token terms (no roofline)."""

    kv_capacity_tokens: int
    step_s: float = 0.010
    per_seq_s: float = 1e-4
    per_context_s: float = 1e-8
    per_prefill_token_s: float = 2e-5
    domain_to_tokens_per_step: dict[str, float] = field(default_factory=dict)

    def iteration_time(self, shape: IterationShape) -> TableTime:
        return TableTime(
            self.step_s
            + self.per_seq_s * shape.num_decode_seqs
            + self.per_context_s * shape.sum_decode_context
            + self.per_prefill_token_s * shape.num_prefill_tokens
        )

    def decode_run_time_s(self, num_decode_seqs: int, sum_context: int, num_steps: int, tokens_per_step: float = 1.0) -> float:
        growth = num_decode_seqs * tokens_per_step
        summed_context = num_steps * sum_context + growth * num_steps * (num_steps - 1) / 2
        return num_steps * (self.step_s + self.per_seq_s * num_decode_seqs) + self.per_context_s * summed_context

    def spec_tokens_per_step(self, domain: str, num_decode_seqs: int) -> float:
        return self.domain_to_tokens_per_step.get(domain, 1.0)


@dataclass
class Trace:
    """Per-request record of a driven run."""

    req_id_to_tokens: dict[str, int] = field(default_factory=dict)
    req_id_to_first_at: dict[str, float] = field(default_factory=dict)
    req_id_to_finished_at: dict[str, float] = field(default_factory=dict)
    outputs: list[StepOutputs] = field(default_factory=list)
    num_plans: int = 0
    max_num_running: int = 0
    max_kv_used_tokens: int = 0


def make_engine(perf: TablePerf, **config_fields: object) -> Engine:
    return Engine(perf, EngineConfig.from_dict(config_fields))


def drive(engine: Engine, arrivals: list[tuple[float, EngineRequest]], fast_forward: bool) -> Trace:
    """Run arrivals (sorted by time) to completion on a virtual clock; arrivals join at step boundaries."""
    trace = Trace()
    now, index = 0.0, 0
    while index < len(arrivals) or engine.has_work():
        while index < len(arrivals) and arrivals[index][0] <= now:
            assert engine.add_request(arrivals[index][1], now)
            index += 1
        next_arrival_at = arrivals[index][0] if index < len(arrivals) else float("inf")
        horizon_s = (next_arrival_at - now if index < len(arrivals) else 1e9) if fast_forward else 0.0
        plan = engine.schedule(now, horizon_s)
        if plan is None:
            now = next_arrival_at
            continue
        stats = engine.stats(now)
        trace.max_num_running = max(trace.max_num_running, stats.num_running)
        trace.max_kv_used_tokens = max(trace.max_kv_used_tokens, stats.kv_used_tokens)
        now = plan.ended_at
        outputs = engine.update(plan, now)
        trace.num_plans += 1
        trace.outputs.append(outputs)
        for req_id, num in zip(outputs.new_token_req_ids, outputs.num_new_tokens, strict=True):
            trace.req_id_to_tokens[req_id] = trace.req_id_to_tokens.get(req_id, 0) + num
        for req_id in outputs.first_token_req_ids:
            trace.req_id_to_first_at[req_id] = now
        for req_id in outputs.finished_req_ids:
            trace.req_id_to_finished_at[req_id] = now
    return trace
